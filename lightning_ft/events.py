"""A machine-readable event log of what fault tolerance did: one JSON object per line, per process.

Off unless ``LIGHTNING_FT_EVENTS_DIR`` is set (``lightning-ft launch --events-dir`` sets it). Each process appends to
``<dir>/group<G>.rank<R>.jsonl``: its pid and restart attempt at start, each committed step, heals, and a fingerprint
of the final state. The demo and the fault tests read it to find PIDs to kill and to check the outcome; operators
can tail it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

ENV_EVENTS_DIR = "LIGHTNING_FT_EVENTS_DIR"

_sink: TextIO | None = None
_context: dict[str, Any] = {}


def configure(replica_group_id: int, group_rank: int) -> None:
    """Open this process's event file if the event log is enabled."""
    global _sink
    directory = os.environ.get(ENV_EVENTS_DIR)
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"group{replica_group_id}.rank{group_rank}.jsonl"
    if _sink is not None:
        _sink.close()
    _sink = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    _context.clear()
    _context.update(group=replica_group_id, rank=group_rank, pid=os.getpid())


def emit(event: str, **fields: Any) -> None:
    """Append one event; a no-op when the event log is off."""
    if _sink is None:
        return
    record = {"event": event, "time": time.time(), **_context, **fields}
    _sink.write(json.dumps(record) + "\n")


def read_events(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event under ``directory``, in file order per process (for tools and tests)."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("group*.rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by SIGKILL
                    continue
    return records


def enabled() -> bool:
    return _sink is not None

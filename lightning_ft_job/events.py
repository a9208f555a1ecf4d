"""A machine-readable event log of what fault tolerance did: one JSON object per line, per process.

On by default. Each process appends to ``<dir>/group<G>.rank<R>.jsonl``, where ``<dir>`` is

* ``LIGHTNING_FT_EVENTS_DIR`` when it is set (``lightning-ft launch --events-dir`` sets it); set but empty turns the
  log off;
* otherwise ``<Trainer.default_root_dir>/ft_events``: one directory for the whole job, the same for every replica group
  and every restart. (Not the logger's version directory: each group, and each restart of a group, would number its
  versions on its own, and one job's log would be scattered over ``version_0``, ``version_1``, ...)

What is recorded: each process's pid and restart attempt at start, every quorum change, each step's vote (with the
loss), heals and how long they took, skipped and uncommitted steps, exceptions, and the end of training.
``docs/observability.md`` lists every event and field. The fault tests and the chaos monkey read the log to find PIDs
to kill and to check the outcome; ``lightning-ft report`` draws it; operators can tail it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

ENV_EVENTS_DIR = "LIGHTNING_FT_EVENTS_DIR"
DEFAULT_SUBDIR = "ft_events"
FILE_PATTERN = "group*.rank*.jsonl"

log = logging.getLogger(__name__)

_sink: TextIO | None = None
_context: dict[str, Any] = {}
_requested = False


def resolve_directory(default_root_dir: str | os.PathLike[str] | None) -> Path | None:
    """Where this process's event log goes, or ``None`` when it is off (see the module docstring).

    A remote ``default_root_dir`` (``s3://...``) gets no event log: appending line by line needs a local file.
    """
    if ENV_EVENTS_DIR in os.environ:
        directory = os.environ[ENV_EVENTS_DIR]
        return Path(directory) if directory else None
    if default_root_dir is None:
        return None
    if "://" in str(default_root_dir):
        log.info("lightning-ft: no event log under the remote %s; set %s for one", default_root_dir, ENV_EVENTS_DIR)
        return None
    return Path(default_root_dir) / DEFAULT_SUBDIR


def configure(replica_group_id: int, group_rank: int, default_root_dir: str | os.PathLike[str] | None = None) -> None:
    """Open this process's event file (closing a previous one), unless the event log is off."""
    global _sink, _requested
    directory = resolve_directory(default_root_dir)
    _requested = bool(os.environ.get(ENV_EVENTS_DIR))
    if _sink is not None:
        _sink.close()
        _sink = None
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"group{replica_group_id}.rank{group_rank}.jsonl"
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
    for path in sorted(Path(directory).glob(FILE_PATTERN)):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by SIGKILL
                    continue
    return records


def enabled() -> bool:
    """Whether events are being written (so that a caller can skip work that only feeds the log)."""
    return _sink is not None


def requested() -> bool:
    """Whether the log location was asked for explicitly (``LIGHTNING_FT_EVENTS_DIR``), as the fault tests, the chaos
    monkey and the demo do. Costly diagnostics (a fingerprint of the whole final state: with FSDP, a gather of every
    shard) are recorded only then, never by default."""
    return _sink is not None and _requested

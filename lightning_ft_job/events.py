"""A machine-readable event log of what fault tolerance did: one JSON object per line, per process.

For a launched run, on by default. Each process appends to ``<dir>/group<G>.rank<R>.jsonl``, where ``<dir>`` is

* ``LIGHTNING_FT_EVENTS_DIR`` when it is set (``lightning-ft launch --events-dir`` sets it): exactly that directory,
  the caller's choice; set but empty turns the log off;
* otherwise, when a launcher gave the run an id, ``<Trainer.default_root_dir>/ft_events/<run id>`` (a fit that no
  launcher started, in a script, a notebook or a test, writes no log unless asked): one directory per run, the same for
  every replica group and every restart of the run, and never a previous run's. The run id (:func:`run_id`) is
  ``LIGHTNING_FT_RUN_ID`` (``lightning-ft launch`` sets one per job; recipes that start groups elsewhere set their
  scheduler's job id), else torchrun's run id (``--rdzv-id``, ``--standalone``: the same for every restart of one
  torchrun job), else a new id per fit; the ranks of a group take their rank 0's (``FTStrategy`` broadcasts it:
  Lightning's own launcher of several processes sets no run id).

(Not the logger's version directory itself: each restart of a group numbers its logger versions on its own, so one
run's log would be scattered over ``version_0``, ``version_1``, ... Instead the process that owns the loggers, rank 0
of group 0, leaves a pointer to the run's event directory in its log directory, :data:`RUN_POINTER`, which is how
``lightning-ft report <the logger's directory>`` finds that run and no other.)

What is recorded: each process's pid and restart attempt at start, every quorum change, each step's vote (with the
loss), heals and how long they took, skipped and uncommitted steps, exceptions, and the end of training.
``docs/observability.md`` lists every event and field. The fault tests and the chaos monkey read the log to find PIDs
to kill and to check the outcome; ``lightning-ft report`` draws it; operators can tail it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, TextIO

from lightning_ft_job.environment import ENV_TORCHRUN_RUN_ID

ENV_EVENTS_DIR = "LIGHTNING_FT_EVENTS_DIR"
ENV_RUN_ID = "LIGHTNING_FT_RUN_ID"
DEFAULT_SUBDIR = "ft_events"
FILE_PATTERN = "group*.rank*.jsonl"
# Written into the loggers' log directory by the process that owns the loggers: where that run's event log is.
RUN_POINTER = "ft_run.json"

log = logging.getLogger(__name__)

_sink: TextIO | None = None
_context: dict[str, Any] = {}
_requested = False
_directory: Path | None = None
_fits = itertools.count()


def new_run_id() -> str:
    """A fresh run id: the local time it was made (so that runs sort by name too) and a random suffix."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def given_run_id() -> str | None:
    """The run id a launcher gave this process, the same in every group and restart of the run:
    ``LIGHTNING_FT_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID`` (unless torchrun's placeholder ``none``); None
    for a process nobody will start again as part of the same run (a plain script, a notebook)."""
    for variable in (ENV_RUN_ID, ENV_TORCHRUN_RUN_ID):
        value = os.environ.get(variable, "").strip()
        if value and value != "none":
            return value.replace(os.sep, "_")
    return None


def run_id() -> str:
    """The id of the run this process belongs to: :func:`given_run_id`, else a new one for this fit."""
    return given_run_id() or f"{new_run_id()}-{os.getpid()}-{next(_fits)}"


def resolve_directory(default_root_dir: str | os.PathLike[str] | None, run: str | None = None) -> Path | None:
    """Where this process's event log goes, or ``None`` when it is off (see the module docstring); ``run``: the run
    id, when the caller has agreed on one with the other ranks of its group (else :func:`run_id`).

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
    return Path(default_root_dir) / DEFAULT_SUBDIR / (run or run_id())


def configure(
    replica_group_id: int,
    group_rank: int,
    default_root_dir: str | os.PathLike[str] | None = None,
    run: str | None = None,
) -> None:
    """Open this process's event file (closing a previous one), unless the event log is off. ``run``: as for
    :func:`resolve_directory`."""
    global _sink, _requested, _directory
    directory = resolve_directory(default_root_dir, run)
    _requested = bool(os.environ.get(ENV_EVENTS_DIR))
    if _sink is not None:
        _sink.close()
        _sink = None
    _directory = directory
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


def current_directory() -> Path | None:
    """This process's event directory, while the log is on."""
    return _directory if _sink is not None else None


def point_log_dir_at_run(log_dir: str | os.PathLike[str] | None) -> None:
    """Leave :data:`RUN_POINTER` in a logger's ``log_dir``: this run's event directory (absolute, and relative to
    ``log_dir`` for a tree that is moved as a whole). A no-op when the log is off or ``log_dir`` is remote."""
    events_dir = current_directory()
    if events_dir is None or log_dir is None or "://" in str(log_dir):
        return
    target = Path(log_dir)
    try:
        target.mkdir(parents=True, exist_ok=True)
        pointer = {"events_dir": str(events_dir.resolve()), "relative": os.path.relpath(events_dir.resolve(), target)}
        partial = target / f".{RUN_POINTER}.partial"
        partial.write_text(json.dumps(pointer) + "\n")
        partial.replace(target / RUN_POINTER)
    except OSError as error:  # the run trains on; only `lightning-ft report <log dir>` cannot find it
        log.warning("lightning-ft: could not point %s at the event log %s: %s", log_dir, events_dir, error)


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


class EventLogReader:
    """Every event under a directory, read incrementally: each call parses only the lines appended since the last.

    For whoever watches a live run (the fault tests' harness polls it several times a second beside the training
    processes): re-reading and re-parsing every file at every poll would cost as much as the job's own work on a busy
    machine. A line is taken once it ends with a newline; a line a SIGKILL cut short, and anything a restarted process
    appended to it, is skipped as :func:`read_events` skips it. The records come in the same order as
    :func:`read_events`: file by file in name order, each in file order.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(directory)
        self._files: dict[Path, tuple[int, list[dict[str, Any]]]] = {}

    def records(self) -> list[dict[str, Any]]:
        for path in self._directory.glob(FILE_PATTERN):
            offset, records = self._files.get(path, (0, []))
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if size < offset:  # replaced by a shorter file: start over
                offset, records = 0, []
            if size > offset:
                with path.open("rb") as file:
                    file.seek(offset)
                    chunk = file.read(size - offset)
                complete = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read once it is finished
                for line in chunk[:complete].splitlines():
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError:  # a line cut short by SIGKILL
                            continue
                offset += complete
            self._files[path] = (offset, records)
        return [record for path in sorted(self._files) for record in self._files[path][1]]


def enabled() -> bool:
    """Whether events are being written (so that a caller can skip work that only feeds the log)."""
    return _sink is not None


def requested() -> bool:
    """Whether the log location was asked for explicitly (``LIGHTNING_FT_EVENTS_DIR``), as the fault tests, the chaos
    monkey and the demo do. Costly diagnostics (a fingerprint of the whole final state: with FSDP, a gather of every
    shard) are recorded only then, never by default."""
    return _sink is not None and _requested

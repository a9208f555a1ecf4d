"""The job's durable record: which checkpoint is its newest, and whether it has finished.

A group that restarts while no live peer is ahead of it must not train from its own initial or stale state as if it
were the whole job (one job, one model). The only state that outlives every group is on disk, in the job's
checkpoint directory, so that is where a run keeps a small record beside its checkpoints, in
``<dirpath>/.lightning_ft/``:

* ``checkpoints.json``: the committed step of every checkpoint file the run wrote, updated by the checkpoint writer
  after each save. It names the run's newest checkpoint, and it is what keeps checkpoints moving forward: a save at a
  lower committed step than the newest one (a group that trained from older state, a stale writer) is refused.
* ``finished.json``: written by each group's rank 0 when its fit ends normally (``max_steps``, ``max_epochs``, or a
  job-wide stop such as ``EarlyStopping``). A group of the run that starts after that, under the same limits,
  stops at once.

**The job is the run, not the folder.** Both files name the run that wrote them (its run id,
:func:`lightning_ft_job.events.given_run_id`), and a group reads only its own run's: a restart of the run (torchrun,
a launcher, a requeued scheduler job with the same ``LIGHTNING_FT_RUN_ID``) resumes and ends with it; a new run in
the same folder trains the model it is given, as Lightning does, unless the user asks to resume (``ckpt_path``, or
the old run's id). A run without a given id (a plain ``fit`` in a script, a notebook or a sweep) has no later lifetime
to read a record, so it keeps none: its checkpoint folder holds what Lightning's holds.

Which directories: those of the ``ModelCheckpoint`` callbacks whose directory is the same for every group, every
restart and every relaunch: an explicit ``dirpath``, or ``<default_root_dir>/checkpoints`` when the Trainer has no
logger. (With a logger and no ``dirpath``, Lightning puts checkpoints under the logger's version directory, which
each process numbers on its own: no group could find another lifetime's files there.)

Files are written to a temporary name and renamed, so a reader never sees half a record; only local or mounted
paths are supported (a remote ``dirpath`` such as ``s3://`` keeps no record).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("lightning.pytorch.lightning_ft")

RECORD_SUBDIR = ".lightning_ft"
CHECKPOINTS_FILE = "checkpoints.json"
FINISHED_FILE = "finished.json"


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    step: int


@dataclass(frozen=True)
class FinishedJob:
    """How a job ended: its committed step, its epoch, and the limits it ran under."""

    directory: Path
    step: int
    epoch: int
    max_steps: int
    max_epochs: int | None
    reason: str

    def applies_to(self, max_steps: int, max_epochs: int | None) -> bool:
        """Whether a group with these limits would have nothing left to do. A relaunch with larger limits continues
        the job instead (from its newest checkpoint)."""
        return max_steps == self.max_steps and max_epochs == self.max_epochs


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(partial, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("lightning-ft: ignoring the unreadable job record %s: %s", path, error)
        return None


class JobRecord:
    """One run's durable record, kept in its checkpoint directories (none: the run keeps no record).

    Args:
        directories: The run's durable checkpoint directories (:func:`durable_checkpoint_dirs`).
        run: The run's id; only this run's entries are read, and a save replaces another run's record.
    """

    def __init__(self, directories: Iterable[str | os.PathLike[str]], run: str = "") -> None:
        self.directories: list[Path] = sorted({Path(directory) for directory in directories})
        self.run = run

    def _own(self, data: dict[str, Any] | None) -> dict[str, Any] | None:
        """``data`` if this run wrote it (a record from before runs were named counts as any run's)."""
        if data is None or data.get("run", self.run) != self.run:
            return None
        return data

    def other_runs(self) -> dict[Path, str]:
        """The directories whose record another run wrote, with that run's id: a new run in a used folder."""
        others = {}
        for directory in self.directories:
            data = _read_json(directory / RECORD_SUBDIR / CHECKPOINTS_FILE)
            if data is not None and data.get("run", self.run) != self.run and data.get("files"):
                others[directory] = str(data["run"])
        return others

    @property
    def exists(self) -> bool:
        """Whether the job has a checkpoint directory to keep a record in."""
        return bool(self.directories)

    def _steps(self, directory: Path) -> dict[str, int]:
        data = self._own(_read_json(directory / RECORD_SUBDIR / CHECKPOINTS_FILE))
        return {str(name): int(step) for name, step in (data or {}).get("files", {}).items()}

    def newest(self) -> SavedCheckpoint | None:
        """The checkpoint at the highest committed step that is still on disk (the later-written one on a tie)."""
        best: SavedCheckpoint | None = None
        for directory in self.directories:
            for name, step in self._steps(directory).items():
                path = directory / name
                if not path.is_file():
                    continue
                later = best is not None and step == best.step and path.stat().st_mtime > best.path.stat().st_mtime
                if best is None or step > best.step or later:
                    best = SavedCheckpoint(path, step)
        return best

    def wrote(self, filepath: str | os.PathLike[str]) -> bool:
        """Whether this run wrote ``filepath`` (a checkpoint name it may write again)."""
        path = Path(os.path.realpath(filepath))
        return self.exists and path.name in self._steps(path.parent)

    def newest_step(self, directory: Path) -> int | None:
        steps = self._steps(directory)
        return max(steps.values()) if steps else None

    def refuse_save(self, filepath: str | os.PathLike[str], step: int) -> str | None:
        """Why a save of ``step`` to ``filepath`` must not happen, or None: the file's directory already holds the
        job at a later committed step, so this state is older than the job's (or from another lineage)."""
        directory = Path(filepath).parent
        newest = self.newest_step(directory)
        if newest is not None and step < newest:
            return (
                f"{directory} already holds the job at committed step {newest}, and this state is at step {step}: "
                f"it is older than the job's (a group that trained from an earlier state), so it would overwrite "
                f"newer work"
            )
        return None

    def record_save(self, filepath: str | os.PathLike[str], step: int) -> None:
        """Note that ``filepath`` now holds committed step ``step`` (the checkpoint writer, after a save)."""
        if not self.exists:
            return
        path = Path(filepath)
        record = path.parent / RECORD_SUBDIR / CHECKPOINTS_FILE
        data = self._own(_read_json(record)) or {}
        files = {name: s for name, s in data.get("files", {}).items() if (path.parent / name).exists()}
        files[path.name] = int(step)
        _write_json(record, {"run": self.run, "files": files, "updated": time.time()})

    def record_removal(self, filepath: str | os.PathLike[str]) -> None:
        if not self.exists:
            return
        path = Path(filepath)
        record = path.parent / RECORD_SUBDIR / CHECKPOINTS_FILE
        data = self._own(_read_json(record))
        if data and path.name in data.get("files", {}):
            data["files"].pop(path.name)
            _write_json(record, data)

    def finished(self) -> FinishedJob | None:
        """How the job ended, if it has."""
        for directory in self.directories:
            data = self._own(_read_json(directory / RECORD_SUBDIR / FINISHED_FILE))
            if data is not None:
                return FinishedJob(
                    directory=directory,
                    step=int(data["step"]),
                    epoch=int(data["epoch"]),
                    max_steps=int(data["max_steps"]),
                    max_epochs=None if data.get("max_epochs") is None else int(data["max_epochs"]),
                    reason=str(data.get("reason", "")),
                )
        return None

    def mark_finished(self, step: int, epoch: int, max_steps: int, max_epochs: int | None, reason: str) -> None:
        record = {
            "run": self.run,
            "step": step,
            "epoch": epoch,
            "max_steps": max_steps,
            "max_epochs": max_epochs,
            "reason": reason,
            "time": time.time(),
        }
        for directory in self.directories:
            _write_json(directory / RECORD_SUBDIR / FINISHED_FILE, record)

    def clear_finished(self) -> None:
        """A job continued past its recorded end (relaunched with larger limits) is no longer finished."""
        for directory in self.directories:
            if self._own(_read_json(directory / RECORD_SUBDIR / FINISHED_FILE)) is not None:
                (directory / RECORD_SUBDIR / FINISHED_FILE).unlink(missing_ok=True)


def durable_checkpoint_dirs(trainer: Any) -> list[Path]:
    """The checkpoint directories that every group, restart and relaunch of the job resolves alike (see the module
    docstring). Read before ``ModelCheckpoint.setup`` resolves its own default, so computed here the same way."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    directories = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        directory = callback.dirpath
        if directory is None and not trainer.loggers:
            directory = os.path.join(trainer.default_root_dir, "checkpoints")
        if directory is None or "://" in str(directory):
            continue
        directories.append(Path(os.path.realpath(os.path.expanduser(str(directory)))))
    return directories

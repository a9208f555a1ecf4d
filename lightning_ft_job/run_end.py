"""The run's end, as its groups report it: one small file per group whose fit ended the job, in a folder of the run's.

"The job" is one run (one run id: :func:`lightning_ft_job.events.run_id`), not a folder. When a group's fit ends the
job (``max_steps``, ``max_epochs``, or a job-wide stop), its rank 0 writes ``run_end.<run id>.group<G>.json`` here.
Two readers act on it:

* a group of the same run that starts or restarts afterwards (a torchrun restart that came back after its peers
  finished) reads it before it waits for anyone, says so in one line and exits 0, instead of waiting for peers that are
  gone (:mod:`lightning_ft.start.lifecycle`);
* ``lightning-ft launch`` reads it on every poll: a group that reported its end has finished, whatever its process
  does afterwards (an exit code other than 0 during teardown is logged once, never counted as a failure).

Where: ``LIGHTNING_FT_RUN_END_DIR`` (``lightning-ft launch`` sets a folder of its own for each launch; a scheduler
that starts groups on several hosts can give a shared path), else the run's event directory (the same for every group
and restart of a run on one machine). Neither: no report, and a group restarted after the end waits for peers as
before, until its launcher stops it (``--finish-grace``).

Torch-free: the launcher imports it. Files are written to a temporary name and renamed, so a reader never sees half
of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV_RUN_END_DIR = "LIGHTNING_FT_RUN_END_DIR"
_PREFIX = "run_end."


@dataclass(frozen=True)
class GroupFinished:
    """One group's report that its fit ended the run: at which committed step, and why."""

    run_id: str
    group: int
    step: int
    reason: str


def _in_name(run_id: str) -> str:
    return run_id.replace(os.sep, "_")


def write_json(path: Path, data: dict[str, object]) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, sort_keys=True))
    os.replace(partial, path)


def report_finished(directory: str | os.PathLike[str], report: GroupFinished) -> None:
    """Write ``report`` into ``directory`` (created if missing)."""
    write_json(Path(directory) / f"{_PREFIX}{_in_name(report.run_id)}.group{report.group}.json", report.__dict__)


def finished_groups(directory: str | os.PathLike[str] | None, run_id: str) -> dict[int, GroupFinished]:
    """Every group of run ``run_id`` that reported its end in ``directory``, by group id (none if no directory)."""
    if directory is None:
        return {}
    reports = {}
    prefix = f"{_PREFIX}{_in_name(run_id)}.group"
    try:
        paths = [path for path in Path(directory).iterdir() if path.name.startswith(prefix)]
    except FileNotFoundError:
        return {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
            report = GroupFinished(str(data["run_id"]), int(data["group"]), int(data["step"]), str(data["reason"]))
        except (OSError, ValueError, KeyError, TypeError):  # removed meanwhile, or not one of ours: not a report
            continue
        if report.run_id == run_id:
            reports[report.group] = report
    return reports


def _reached_path(directory: str | os.PathLike[str], run_id: str) -> Path:
    return Path(directory) / f"run_reached.{_in_name(run_id)}.json"


def record_reached(directory: str | os.PathLike[str], run_id: str, step: int) -> None:
    """Remember that run ``run_id`` had committed step ``step`` (kept at its highest): what the lighthouse's last quorum
    said when a restarted group looked. The lighthouse forgets it as soon as restarted groups form a quorum of their
    own, at step 0; a later restart must still know that the job was past it."""
    if step <= reached(directory, run_id):
        return
    write_json(_reached_path(directory, run_id), {"run_id": run_id, "step": int(step)})


def reached(directory: str | os.PathLike[str] | None, run_id: str) -> int:
    """The highest committed step remembered for run ``run_id`` (:func:`record_reached`), 0 if none."""
    if directory is None:
        return 0
    try:
        return int(json.loads(_reached_path(directory, run_id).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def configured_directory() -> Path | None:
    """``LIGHTNING_FT_RUN_END_DIR`` when it is set and not empty, else None."""
    value = os.environ.get(ENV_RUN_END_DIR, "").strip()
    return Path(value) if value else None

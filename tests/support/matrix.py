"""Figures for the fault test matrix in docs/reliability.md, measured from a test's own event log.

Each fault test calls :func:`record` once its assertions have passed (so a row always describes a run whose replicas
ended bit-identical with the exact committed step count). The row is printed, and appended as one JSON line to
``$LIGHTNING_FT_MATRIX_OUT`` when that is set: ``make fault-matrix`` runs the matrix that way and renders the table.
Nothing here is asserted; timings depend on the machine.
"""

from __future__ import annotations

import json
import os
from typing import Any

from harness import LaunchedJob

ENV_MATRIX_OUT = "LIGHTNING_FT_MATRIX_OUT"


def _first_commit_after(job: LaunchedJob, group: int, after: float, **match: Any) -> float | None:
    times = [e["time"] for e in job.events("step", group=group, rank=0, committed=True, **match) if e["time"] > after]
    return min(times) - after if times else None


def record(case: str, job: LaunchedJob, *, failed_at: float, victim: int, survivors: list[int], **extra: Any) -> None:
    """Measure one failure of ``victim`` at ``failed_at`` (epoch seconds) and report it.

    * ``steps_lost``: steps the survivors ran that did not commit (the most in any survivor group);
    * ``survivors_resumed_s``: from the failure to the survivors' first commit after it (the slowest survivor);
    * ``victim_committed_s``: from the failure to the victim group's first commit after it, restart and heal included;
    * ``victim_restart_to_heal_s``: from the victim's new process starting (after imports: the ``started`` event) to
      its heal, when it restarted.
    """
    lost = max(len(job.events("step", group=g, rank=0, committed=False)) for g in survivors)
    resumed = [_first_commit_after(job, g, failed_at) for g in survivors]
    row: dict[str, Any] = {
        "case": case,
        "steps_lost": lost,
        "survivors_resumed_s": None if None in resumed else round(max(r for r in resumed if r is not None), 2),
        "victim_committed_s": _rounded(_first_commit_after(job, victim, failed_at)),
        "identical": True,
        **extra,
    }
    restarts = [e for e in job.events("started", group=victim, rank=0) if e["time"] > failed_at]
    if restarts:
        heals = [e["time"] for e in job.events("healed", group=victim, rank=0, pid=restarts[0]["pid"])]
        row["victim_restart_to_heal_s"] = _rounded(heals[0] - restarts[0]["time"]) if heals else None
    write(row)


def write(row: dict[str, Any]) -> None:
    """Print one row of the matrix, and append it to ``$LIGHTNING_FT_MATRIX_OUT`` when set."""
    print(f"fault matrix: {json.dumps(row)}")
    out = os.environ.get(ENV_MATRIX_OUT)
    if out:
        with open(out, "a") as sink:
            sink.write(json.dumps(row) + "\n")


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)

"""The process tests' harness (``tests/support/harness.py``) and fault-schedule executor
(``tests/support/fault_schedules.py``) for the drivers that start and watch a job with them (``kill_loop``,
``scale_kills``, ``soak``), and the tests' way to join a cross-group process group without a Manager
(``tests/support/torchft_groups.py``, for ``zoo/collective_cost.py``).

``tests/`` is not a package: its conftest puts ``tests/support/`` (the harness and its ``helpers`` module) and every
test folder on ``sys.path``. This module does the same, once, and is the only place in ``benchmarks/`` that touches
``sys.path``; a driver imports ``launch_job`` and ``LaunchedJob`` from here.
"""

from __future__ import annotations

import sys

from benchmarks.common.run_util import REPO

for _folder in (REPO / "tests" / "support",):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from fault_schedules import PATHS as FAULT_SCHEDULE_PATHS  # noqa: E402
from fault_schedules import (  # noqa: E402
    POINTS,
    FaultSchedule,
    Kill,
    carry_out,
    check_invariants,
)
from harness import LaunchedJob, launch_job  # noqa: E402
from torchft_groups import reconfigure_without_manager  # noqa: E402

__all__ = [
    "FAULT_SCHEDULE_PATHS",
    "POINTS",
    "FaultSchedule",
    "Kill",
    "LaunchedJob",
    "carry_out",
    "check_invariants",
    "launch_job",
    "reconfigure_without_manager",
]

"""The process tests' harness (``tests/support/harness.py``) for the drivers that start and watch a job with it
(``kill_loop``, ``scale_kills``).

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

from harness import LaunchedJob, launch_job  # noqa: E402

__all__ = ["LaunchedJob", "launch_job"]

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import LaunchedJob, launch_job


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    """Start jobs with ``launch(name, groups=..., worker_args=[...])``; every job is stopped at teardown."""
    jobs: list[LaunchedJob] = []

    def start(name: str = "job", **kwargs) -> LaunchedJob:
        job = launch_job(tmp_path / name, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop()

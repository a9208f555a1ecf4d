"""Real-process tests: real lighthouses, torchrun groups, SIGKILL by PID. Every test in this folder carries the
``multiprocess`` marker; ``launch`` starts a job and stops it at teardown, even when the test fails."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness.py, matrix.py, netns.py, workers/

from harness import LaunchedJob, launch_job  # noqa: E402 - after the path insert


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.multiprocess)


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

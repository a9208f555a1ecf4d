from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import LaunchedJob, launch_job


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """An in-process fit writes MASTER_PORT, OMP_NUM_THREADS, RANK... into this process's environment (Lightning's
    DDP setup). Left there, they leak into later tests and into the subprocesses those start (a MASTER_PORT still
    held by this process's store fails their bind)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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

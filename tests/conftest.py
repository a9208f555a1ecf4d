from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The tests mirror the package (tests/<concept>/test_*.py); the helpers they share are in tests/support/ (the models
# and trainers of helpers.py, the real-process harness, the workers). Every folder is importable by module name, as
# pytest's default import mode makes each test's own folder, so that a test may use another's scenario helpers
# whatever order the folders are collected in.
for _folder in sorted(path for path in TESTS.iterdir() if path.is_dir() and not path.name.startswith((".", "_"))):
    sys.path.insert(0, str(_folder))

from harness import LaunchedJob, launch_job  # noqa: E402 - after the path insert

from lightning_ft_job.events import ENV_EVENTS_DIR  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts a job (the ``launch`` fixture) must say so with the ``multiprocess`` marker, which is how
    the in-process tests are selected alone (``-m "not multiprocess"``)."""
    unmarked = [
        item.nodeid
        for item in items
        if "launch" in getattr(item, "fixturenames", ()) and item.get_closest_marker("multiprocess") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests that start jobs without the multiprocess marker: " + ", ".join(unmarked))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    """Start jobs with ``launch(name, groups=..., worker_args=[...])``; every job is stopped at teardown, even when the
    test fails."""
    jobs: list[LaunchedJob] = []

    def start(name: str = "job", **kwargs) -> LaunchedJob:
        job = launch_job(tmp_path / name, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop()


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """An in-process fit writes MASTER_PORT, OMP_NUM_THREADS, RANK... into this process's environment (Lightning's
    DDP setup). Left there, they leak into later tests and into the subprocesses those start (a MASTER_PORT still
    held by this process's store fails their bind)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _event_log_off_unless_asked_for() -> Iterator[None]:
    """FTStrategy writes its event log under ``default_root_dir`` by default, which for most in-process fits here is
    the working directory (the repository). Tests turn it off (set but empty), as it was before it became a default;
    a test that wants it deletes the variable or points it somewhere (``lightning-ft launch --events-dir`` does).
    Session-wide, so that module-scoped fixtures that fit (test_state.py, test_data_position.py) see it too."""
    previous = os.environ.get(ENV_EVENTS_DIR)
    os.environ[ENV_EVENTS_DIR] = ""
    yield
    if previous is None:
        os.environ.pop(ENV_EVENTS_DIR, None)
    else:
        os.environ[ENV_EVENTS_DIR] = previous


@pytest.fixture
def one_group_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No replica-group variables from the calling shell: a fit is one group with its own embedded lighthouse."""
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)

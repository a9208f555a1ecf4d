from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # support.py

from lightning_ft_job.events import ENV_EVENTS_DIR


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

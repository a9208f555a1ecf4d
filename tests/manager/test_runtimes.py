"""torchft's RPC runtimes in a training process run one worker thread each, unless the user set
TOKIO_WORKER_THREADS (lightning_ft/manager/runtimes.py); the setting does not outlive the Manager's construction.

Each fit runs in a fresh interpreter: a runtime of an earlier fit in the same process may keep its threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from lightning_ft.manager.runtimes import THREADS_VARIABLE
from lightning_ft_job.environment import ENV_HOSTNAME

# A one-group fit that reports, at its first training batch, its threads by name and the variable as training sees it.
FIT = """
import collections, json, os, sys
from pathlib import Path
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_ft import FTStrategy

class Record(pl.Callback):
    seen = None
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen is None:
            names = collections.Counter()
            for task in Path("/proc/self/task").iterdir():
                try:
                    names[(task / "comm").read_text().strip()] += 1
                except OSError:
                    pass
            self.seen = {"threads": names, "variable": os.environ.get(sys.argv[1])}

record = Record()
trainer = pl.Trainer(
    strategy=FTStrategy(), accelerator="cpu", devices=1, max_steps=2, callbacks=[record], logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[2],
)
trainer.fit(BoringModel())
print("RESULT " + json.dumps(record.seen))
"""


def _fit(tmp_path, **variables: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in _CLEARED}
    env.update(variables, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", FIT, THREADS_VARIABLE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


_CLEARED = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", ENV_HOSTNAME, THREADS_VARIABLE)


@pytest.mark.timeout(180)
def test_the_managers_server_and_client_run_one_worker_thread_each(tmp_path):
    seen = _fit(tmp_path)
    assert seen["threads"].get("torchft-manager") == 1, seen["threads"]
    assert seen["threads"].get("torchft-mgrclnt") == 1, seen["threads"]
    assert seen["variable"] is None  # nothing after the Manager's construction sees it (data loader workers)


@pytest.mark.timeout(180)
def test_a_users_tokio_worker_threads_wins(tmp_path):
    seen = _fit(tmp_path, **{THREADS_VARIABLE: "3"})
    assert seen["threads"].get("torchft-manager") == 3, seen["threads"]
    assert seen["threads"].get("torchft-mgrclnt") == 3, seen["threads"]
    assert seen["variable"] == "3"

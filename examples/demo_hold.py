"""The one piece of `make demo` that is not plain training: a callback that holds a replica group between steps.

The demo kills group 1 and wants to show group 0 training alone, then group 1 healing from it. How long torchrun
takes to bring group 1 back (imports, a new Manager) depends on the machine's load; on a busy machine group 0 could
finish every remaining step first, and there would be nobody to heal from. So after group 0 has shown a few steps on
its own, the demo creates ``hold.group0`` in the run directory; this callback then waits at the start of group 0's
next step until the demo removes the file (once group 1's new worker is up).

Holding between steps is harmless to the job: group 0's Manager keeps heartbeating to the lighthouse, so the
lighthouse keeps waiting for it rather than forming a quorum of group 1 alone, and the next quorum has both groups.
The hold has a deadline, so a demo that dies mid-hold cannot leave the job waiting forever.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_ft_job.environment import ENV_REPLICA_GROUP_ID


class HoldWhileFileExists(pl.Callback):
    """Waits at each training step's start while ``<directory>/hold.group<G>`` exists, for at most ``max_hold_s``."""

    def __init__(self, directory: str = ".", max_hold_s: float = 120.0) -> None:
        self.path = Path(directory) / f"hold.group{os.environ.get(ENV_REPLICA_GROUP_ID, '0')}"
        self.max_hold_s = max_hold_s

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        deadline = time.monotonic() + self.max_hold_s
        while self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

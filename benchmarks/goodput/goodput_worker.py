"""One process of a goodput run (started by ``benchmarks/goodput/goodput.py``; not meant to be run by hand).

``--mode restart``: one of 3 ranks of Lightning's ``DDPStrategy`` over Gloo under ``torchrun --max-restarts``, saving
``last.ckpt`` every ``--every`` steps and resuming from it after a restart: the classic approach of the torchrun
tutorial, in Lightning. ``--mode ft``: one replica group of 1 process with ``FTStrategy()`` under
``lightning-ft launch --max-restarts``. Both train the 1M-parameter MLP of ``benchmarks/common/bench_model.py`` until
stopped.

Each process writes, line-buffered, so that a SIGKILL loses nothing that happened:

* ``pids/<who>.pid``: its PID once training starts (the driver kills by that PID);
* ``steps/<who>.<pid>.txt``: one line per optimizer step: wall time, committed step count, samples committed by the
  whole job so far, participants;
* ``timeline/<who>.<pid>.json``: when the interpreter started, when imports were done, when training started.
"""

from __future__ import annotations

import time

EXEC_TIME = time.time()  # before the imports: a restart's import time is part of its cost

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.common.bench_model import SIZES, RegressionModule, SyntheticRegression  # noqa: E402
from lightning_ft import FTStrategy  # noqa: E402

IMPORTED_TIME = time.time()
torch.set_num_threads(1)


class RenamingCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file, then rename: a SIGKILL during a save leaves the previous ``last.ckpt`` whole. No
    fsync: the baseline gets the cheapest save that still survives a killed process."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        temporary = f"{path}.tmp"
        torch.save(checkpoint, temporary)
        os.replace(temporary, path)


class Recorder(pl.Callback):
    """Writes the pid file, the timeline and one line per optimizer step (see the module docstring)."""

    def __init__(self, root: Path, who: str, batch_size: int, world: int) -> None:
        self.root, self.who, self.batch_size, self.world = root, who, batch_size, world
        pid = os.getpid()
        (root / "steps").mkdir(parents=True, exist_ok=True)
        self.steps = (root / "steps" / f"{who}.{pid}.txt").open("a", buffering=1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pid = os.getpid()
        for folder in ("pids", "timeline"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        timeline = {"exec": EXEC_TIME, "imported": IMPORTED_TIME, "train_start": time.time(), "pid": pid}
        (self.root / "timeline" / f"{self.who}.{pid}.json").write_text(json.dumps(timeline))
        pid_file = self.root / "pids" / f"{self.who}.pid"
        pid_file.with_suffix(".tmp").write_text(str(pid))
        os.replace(pid_file.with_suffix(".tmp"), pid_file)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, FTStrategy):
            manager = strategy.manager
            committed = bool(strategy.step_protocol.last_step_committed)
            samples = manager.batches_committed() * self.batch_size
            participants = manager.num_participants() if committed else 0
        else:
            committed, participants = True, self.world
            samples = trainer.global_step * self.world * self.batch_size
        if committed:
            self.steps.write(f"{time.time():.6f} {trainer.global_step} {samples} {participants}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["restart", "ft"], required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--every", type=int, default=50, help="restart mode: checkpoint every this many steps")
    parser.add_argument("--world", type=int, default=3)
    args = parser.parse_args()
    size = SIZES["1m"]
    data = SyntheticRegression(size.width, size.batch_size, length=2 * 10**6)  # minutes per epoch
    ckpt_path = None
    plugins: list[Any] = []
    callbacks: list[pl.Callback] = []
    if args.mode == "restart":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        devices = args.world
        who = f"rank{os.environ.get('RANK', '0')}"
        checkpoints = args.root / "checkpoints"
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=args.every, save_last=True, save_top_k=0)
        )
        plugins.append(RenamingCheckpointIO())
        if (checkpoints / "last.ckpt").exists():
            ckpt_path = str(checkpoints / "last.ckpt")
    else:
        strategy = FTStrategy()
        devices = 1
        who = f"group{os.environ.get('REPLICA_GROUP_ID', '0')}"
    callbacks.append(Recorder(args.root, who, size.batch_size, args.world))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=plugins,
        max_steps=-1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=args.mode == "restart",
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(args.root / "lightning"),
        callbacks=callbacks,
    )
    trainer.fit(RegressionModule("1m"), DataLoader(data, batch_size=size.batch_size), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()

"""One process of a ``zoo.py`` run (not meant to be run by hand).

``--mode ddp``: one of 2 ranks of Lightning's ``DDPStrategy`` over Gloo, under ``torchrun``. ``--mode ft``: one
replica group of 1 process with ``FTStrategy()`` (its defaults), under ``lightning-ft launch``; ``--mode ft_pinned``
the same with ``FTStrategy(find_unused_parameters=False)`` (no graph traversal, buckets pinned in forward order),
``--mode ft_sync`` with ``FTStrategy(use_async_quorum=False)`` (the quorum before the forward pass, not beside it).
Every mode trains the zoo model ``--model`` with ``accumulate_grad_batches=--accumulate`` and writes the time each
optimizer step ended (``time.perf_counter``) to ``--out`` with their rank or group before the suffix (``steps.0.json``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from benchmarks.common.overhead_worker import write
from benchmarks.zoo.zoo_models import ZOO, ZooBatches, ZooModule
from lightning_ft import FTStrategy

torch.set_num_threads(1)  # the same intra-op threads in every mode


class OptimizerStepClock(pl.Callback):
    """The end of every ``accumulate``-th batch: where an optimizer step (and its gradient exchange) ended."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.batches = 0
        self.step_ends: list[float] = []

    def on_train_batch_end(self, *_: Any) -> None:
        self.batches += 1
        if self.batches % self.accumulate == 0:
            self.step_ends.append(time.perf_counter())


class CriticalPathClock(pl.Callback):
    """What lies between one step's decision and the next step's first kernel: when each optimizer step ends (a step
    post-hook on the real optimizer), when each FTStrategy vote ends (around ``Manager.should_commit``), and when each
    forward pass starts (a pre-hook on the model's network, the first module its ``training_step`` calls)."""

    def __init__(self) -> None:
        self.optimizer_ends: list[float] = []
        self.vote_ends: list[float] = []
        self.forward_starts: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.optimizer_ends.append(time.perf_counter()))
        pl_module.net.register_forward_pre_hook(lambda *_: self.forward_starts.append(time.perf_counter()))
        manager = getattr(trainer.strategy, "manager", None)
        if manager is not None:
            should_commit = manager.should_commit

            def timed_vote(*args: Any, **kwargs: Any) -> bool:
                try:
                    return should_commit(*args, **kwargs)
                finally:
                    self.vote_ends.append(time.perf_counter())

            manager.should_commit = timed_vote

    def record(self) -> dict[str, list[float]]:
        return {
            "optimizer_ends": self.optimizer_ends,
            "vote_ends": self.vote_ends,
            "forward_starts": self.forward_starts,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "ft", "ft_pinned", "ft_sync"], required=True)
    parser.add_argument("--model", choices=sorted(ZOO), required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    if args.mode == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        devices = world = int(os.environ.get("WORLD_SIZE", "2"))  # torchrun's world: zoo.py --processes
    else:
        strategy = FTStrategy(find_unused_parameters=args.mode != "ft_pinned", use_async_quorum=args.mode != "ft_sync")
        devices, world = 1, int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    spec = ZOO[args.model]
    batches = args.steps * args.accumulate
    data = ZooBatches(spec, length=batches * spec.batch_size * world)
    clock = OptimizerStepClock(args.accumulate)
    path = CriticalPathClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=1,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.root,
        callbacks=[clock, path],
    )
    started = time.perf_counter()
    trainer.fit(ZooModule(args.model), DataLoader(data, batch_size=spec.batch_size))
    rank = trainer.global_rank if args.mode == "ddp" else int(os.environ.get("REPLICA_GROUP_ID", "0"))
    write(
        args.out.with_name(f"{args.out.stem}.{rank}.json"),
        clock.step_ends,
        started,
        {"global_step": trainer.global_step, **path.record()},
    )


if __name__ == "__main__":
    main()

"""One replica group of a semi-synchronous benchmark run (started by ``benchmarks/semi_sync/semi_sync.py`` through
``lightning-ft launch``; not meant to be run by hand).

Trains :class:`benchmarks.common.tiny_lm.TinyLM` with ``FTStrategy(algorithm=...)`` to ``--max-steps`` inner steps
and writes, per group, the final model weights and a JSON file of what crossed between groups:

* every tensor handed to the torchft Manager's ``allreduce`` (count and bytes: ``numel * element_size``), which is
  everything the strategy sends between groups: DDP's gradient buckets, LocalSGD's parameters, DiLoCo's
  pseudo-gradients, and the small tensors of cross-group decisions;
* the ``lo`` interface's byte counters from ``/proc/self/net/dev`` after the job's first step and at the end (in a
  private network namespace these are exactly this job's loopback traffic; see ``semi_sync.py``).

The driver starts it by its path with the repository root on ``PYTHONPATH``, so ``benchmarks.common`` imports.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks.common.tiny_lm import TinyLM, Windows, load_corpus
from lightning_ft import FTStrategy


def loopback_bytes(net_dev: str = "/proc/self/net/dev") -> tuple[int, int]:
    """(received, transmitted) bytes of the ``lo`` interface, as the network namespace of this process sees them."""
    for line in Path(net_dev).read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no 'lo' interface in {net_dev}")


class AllreduceCounter:
    """Wraps the allreduce of a Manager's cross-group process group (an instance attribute shadowing the method)
    and counts its payloads: every cross-group allreduce passes there, ``Manager.allreduce``'s and the DDP comm
    hook's (``lightning_ft.step.gradient_hooks.cross_group_average``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._target: Any = None

    def install(self, manager: Any) -> None:
        process_group = manager._pg
        original: Callable[..., Any] = process_group.allreduce

        def counting_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            return original(tensors, *args, **kwargs)

        process_group.allreduce = counting_allreduce
        self._target = process_group

    def uninstall(self) -> None:
        if self._target is not None:
            vars(self._target).pop("allreduce", None)
            self._target = None


class Measure(pl.Callback):
    """Counts the cross-group payload from setup on and records the final state after the final sync.

    FTStrategy puts its own callbacks (``SyncCallback`` with the final sync) before the user's, so this callback's
    ``on_train_end`` runs after the final sync.
    """

    def __init__(self, out_dir: Path, group: int) -> None:
        self.out_dir, self.group = out_dir, group
        self.counter = AllreduceCounter()
        self.loopback_after_first_step: tuple[int, int] | None = None
        self.train_start = 0.0
        self.losses: list[float] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The Manager exists from FTStrategy.setup_environment on, which Lightning runs before the setup hooks, so
        # every allreduce of the fit (each looks up the process group's allreduce at each call) is counted.
        self.counter.install(trainer.strategy.manager)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.counter.uninstall()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_start = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        if self.loopback_after_first_step is None:
            # After the join (init_sync's heal of one group from the other) and the first step.
            self.loopback_after_first_step = loopback_bytes()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loopback_end = loopback_bytes()
        strategy = trainer.strategy
        assert isinstance(strategy, FTStrategy)
        manager = strategy.manager
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.state_dict(), self.out_dir / f"model.group{self.group}.pt")
        tail = self.losses[-20:]
        record = {
            "group": self.group,
            "global_step": trainer.global_step,
            "manager_step": manager.current_step(),
            "participants_last_quorum": manager.num_participants(),
            "allreduce_calls": self.counter.calls,
            "allreduce_bytes": self.counter.bytes,
            "loopback_after_first_step": self.loopback_after_first_step,
            "loopback_end": loopback_end,
            "train_seconds": time.monotonic() - self.train_start,
            "train_loss_last20": sum(tail) / max(1, len(tail)),
        }
        (self.out_dir / f"stats.group{self.group}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", choices=["ddp", "local_sgd", "diloco"], required=True)
    parser.add_argument("--sync-every", type=int, default=None)
    parser.add_argument("--fragments", type=int, default=None)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()

    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)  # also seeds the DistributedSampler's shuffle (PL_GLOBAL_SEED)

    algorithm: dict[str, Any] = {"algorithm": args.algorithm}
    if args.algorithm != "ddp":
        algorithm["sync_every"] = args.sync_every
    if args.fragments is not None:
        algorithm["fragments"] = args.fragments
    strategy = FTStrategy(
        **algorithm,
        # Both groups take part in every step and sync: a group that started late must not be left out of the
        # first quorum (the launcher's lighthouse also needs both, --min-replicas=2).
        min_replica_size=2,
        # Loopback only: the job may run in a private network namespace whose only interface is lo.
        hostname="127.0.0.1",
        timeout=120,
        quorum_timeout=300,
        connect_timeout=120,
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Measure(Path(args.out_dir), group)],
    )
    train_text, _ = load_corpus()
    # shuffle=True: Lightning replaces the sampler by a DistributedSampler over FTStrategy.distributed_sampler_kwargs
    # (num_replicas = groups × group size, rank = group id × group size + rank), so each group reads its own shard.
    loader = DataLoader(Windows(train_text), batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer.fit(TinyLM(lr=args.lr), loader)


if __name__ == "__main__":
    main()

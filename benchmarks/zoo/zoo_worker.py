"""One process of a ``zoo.py`` run (not meant to be run by hand).

``--mode ddp``: one of 2 ranks of Lightning's ``DDPStrategy`` over Gloo, under ``torchrun``. ``--mode ft``: one
replica group of 1 process with ``FTStrategy()`` (its defaults), under ``lightning-ft launch``; ``--mode ft_pinned``
the same with ``FTStrategy(find_unused_parameters=False)`` (no graph traversal, buckets pinned in forward order:
what the default chooses for a model of one bucket),
``--mode ft_sync`` with ``FTStrategy(use_async_quorum=False)`` (the quorum before the forward pass, not beside it).
``--mode ddp_torchft``: ``DDPStrategy`` as in ``ddp``, with torchft's per-step protocol beside it and no lightning-ft
code (:class:`TorchftProtocol`): what a fault-tolerant DDP step on torchft pays as torchft ships it, quorum and vote;
``--mode ddp_quorum`` the quorum alone (a one-process group's vote needs no RPC, lightning-ft's ``LocalCommitVote``).
``--mode ddp_as_ft``: ``DDPStrategy`` with the settings ``FTStrategy()`` gives torch's DDP (:func:`ft_ddp_settings`),
``--mode ddp_as_ft_quorum`` the same with torchft's quorum beside it, as ``ddp_quorum``.
Every mode trains the zoo model ``--model`` with ``accumulate_grad_batches=--accumulate`` and writes the time each
optimizer step ended (``time.perf_counter``) to ``--out`` with their rank or group before the suffix (``steps.0.json``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from benchmarks.common.overhead_worker import write
from benchmarks.common.run_util import raw_torchft_manager
from benchmarks.zoo.zoo import FLOOR_MODES, MODES, TORCHRUN_MODES
from benchmarks.zoo.zoo_models import ZOO, ZooBatches, ZooModule
from lightning_ft import FTStrategy
from lightning_ft.configuration import resolve_configuration
from lightning_ft.step.left_out_parameters import search_for_unused_parameters

torch.set_num_threads(1)  # the same intra-op threads in every mode

# The FTStrategy modes: its defaults; no unused-parameter search whatever the model (the default's choice for a
# one-bucket model, such as the 0.3 M MLP); the quorum before the forward pass instead of beside it.
FT_MODES: dict[str, dict[str, Any]] = {
    "ft": {},
    "ft_pinned": {"find_unused_parameters": False},
    "ft_sync": {"use_async_quorum": False},
}


def ft_ddp_settings(model: torch.nn.Module) -> dict[str, Any]:
    """The keyword arguments ``FTStrategy()``, with its defaults, passes on to ``DDPStrategy`` and torch's DDP for
    ``model`` (its bucket cap, gradients as bucket views, and the unused-parameter search it chooses for this model in
    per-step training), read from FTStrategy's own resolution of its arguments, so that ``ddp_as_ft`` follows any
    change of them."""
    parameters = inspect.signature(FTStrategy.__init__).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    defaults = {p.name: p.default for p in parameters if p.kind in named and p.name != "self"}
    kwargs = dict(resolve_configuration(defaults, {}).ddp_kwargs)
    kwargs["find_unused_parameters"] = search_for_unused_parameters(
        model, kwargs, chosen_by_default=True, per_step=True
    )
    return kwargs


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


class TorchftProtocol(pl.Callback):
    """torchft's per-step protocol beside ``DDPStrategy``, as torchft's README drives it, with no lightning-ft code.

    Each rank is a replica group of one process with a raw torchft ``Manager``; rank 0 hosts the lighthouse, with the
    settings ``lightning-ft launch`` gives its own. Each step starts the quorum when its first batch starts (beside the
    forward pass, as ``FTStrategy`` does), and between the backward pass and the optimizer step waits for it and votes
    (``should_commit``). The gradients cross ranks through DDP's own allreduce, so what this adds to ``ddp`` is the
    protocol alone: a quorum (the lighthouse's round trip, the Manager server, torchft's threads) and a serial vote.
    It waits for the quorum later than ``FTStrategy`` (which needs it at the first bucket), so it can only cost less.
    With ``vote=False`` it only waits for the quorum: the per-step quorum, which no step that torchft's Manager
    coordinates goes without. The Manager's step then stays 0, so it is built with ``init_sync=False``: with torchft's
    default (weights synchronized at step 0) this mode ran at 1.4× the step time of the others.
    """

    def __init__(self, accumulate: int, vote: bool = True) -> None:
        self.accumulate = accumulate
        self.vote = vote
        self.manager: Any = None
        self.lighthouse: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        from lightning_ft_job.lighthouse_server import start_lighthouse

        address: list[str | None] = [None]
        if trainer.global_rank == 0:
            self.lighthouse = start_lighthouse(min_replicas=trainer.world_size)
            address = [self.lighthouse.address]
        dist.broadcast_object_list(address, src=0)
        os.environ["TORCHFT_LIGHTHOUSE"] = str(address[0])
        self.manager = raw_torchft_manager(
            f"zoo_{trainer.global_rank}", state_dict=dict, load_state_dict=lambda state: None, init_sync=self.vote
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        if index % self.accumulate == 0:
            self.manager.start_quorum()

    def on_before_optimizer_step(self, *_: Any) -> None:
        self.manager.wait_quorum()
        if self.vote:
            self.manager.should_commit()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


class CriticalPathClock(pl.Callback):
    """What lies between one step's decision and the next step's first kernel: when each optimizer step ends (a step
    post-hook on the real optimizer), when each FTStrategy vote ends (around ``Manager.should_commit``), and when each
    forward pass starts (a pre-hook on the model's network, the first module its ``training_step`` calls); and how
    long each vote took (``vote_seconds``: the serial part of the protocol, which no forward or backward pass hides).
    The vote is ``FTStrategy``'s Manager's, or ``protocol``'s (``ddp_torchft``)."""

    def __init__(self, protocol: TorchftProtocol | None = None) -> None:
        self.protocol = protocol
        self.optimizer_ends: list[float] = []
        self.vote_ends: list[float] = []
        self.vote_seconds: list[float] = []
        self.forward_starts: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.optimizer_ends.append(time.perf_counter()))
        pl_module.net.register_forward_pre_hook(lambda *_: self.forward_starts.append(time.perf_counter()))
        manager = self.protocol.manager if self.protocol is not None else getattr(trainer.strategy, "manager", None)
        if manager is not None:
            should_commit = manager.should_commit

            def timed_vote(*args: Any, **kwargs: Any) -> bool:
                started = time.perf_counter()
                try:
                    return should_commit(*args, **kwargs)
                finally:
                    self.vote_ends.append(time.perf_counter())
                    self.vote_seconds.append(self.vote_ends[-1] - started)

            manager.should_commit = timed_vote

    def record(self) -> dict[str, list[float]]:
        return {
            "optimizer_ends": self.optimizer_ends,
            "vote_ends": self.vote_ends,
            "vote_seconds": self.vote_seconds,
            "forward_starts": self.forward_starts,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--model", choices=sorted(ZOO), required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torchrun_mode = args.mode in TORCHRUN_MODES
    protocol = TorchftProtocol(args.accumulate, vote=args.mode == "ddp_torchft") if args.mode in FLOOR_MODES else None
    module = ZooModule(args.model)
    if torchrun_mode:
        as_ft = ft_ddp_settings(module) if args.mode in ("ddp_as_ft", "ddp_as_ft_quorum") else {}
        strategy: Any = DDPStrategy(process_group_backend="gloo", **as_ft)
        devices = world = int(os.environ.get("WORLD_SIZE", "2"))  # torchrun's world: zoo.py --processes
    else:
        strategy = FTStrategy(**FT_MODES[args.mode])
        devices, world = 1, int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    spec = ZOO[args.model]
    batches = args.steps * args.accumulate
    data = ZooBatches(spec, length=batches * spec.batch_size * world)
    clock = OptimizerStepClock(args.accumulate)
    path = CriticalPathClock(protocol)
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
        callbacks=[clock, path, *([protocol] if protocol is not None else [])],
    )
    started = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=spec.batch_size))
    rank = trainer.global_rank if torchrun_mode else int(os.environ.get("REPLICA_GROUP_ID", "0"))
    write(
        args.out.with_name(f"{args.out.stem}.{rank}.json"),
        clock.step_ends,
        started,
        {"global_step": trainer.global_step, **path.record()},
    )


if __name__ == "__main__":
    main()

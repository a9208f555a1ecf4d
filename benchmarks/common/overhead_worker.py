"""One process of a step-time benchmark run (started by ``overhead``, ``buffers``, ``data_modes`` and ``scale``, and
its ``write`` used by ``zoo``'s worker; not meant to be run by hand).

``--mode ddp``: one of ``--processes`` (2) ranks of Lightning's ``DDPStrategy`` over Gloo, under ``torchrun``.
``--mode ft``: one replica group of 1 process with ``FTStrategy`` (its defaults, or ``--ft-args``), under
``lightning-ft launch``.
``--mode torchft``: one replica group of raw torchft without Lightning, the torchft README's loop: ``torchft.Manager``,
``torchft.ddp.DistributedDataParallel`` and ``torchft.optim.OptimizerWrapper``, under ``lightning-ft launch``.

Every mode trains the same model on the same data with the same optimizer, and every process of every mode writes,
for each optimizer step, the time it ended (``time.perf_counter``), and the process's peak RSS, to
``--out`` with its rank (ddp) or replica group (ft, torchft) before the suffix: ``steps.0.json``, ``steps.1.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.bench_model import SIZES, RegressionModule, SyntheticRegression
from benchmarks.common.run_util import raw_torchft_manager

# The same intra-op threads in every mode: torchrun sets OMP_NUM_THREADS=1 only with several processes per node.
torch.set_num_threads(1)

VALIDATION_BATCHES = 2  # per process, in each validation run of --probe-every


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write(out: Path, step_ends: list[float], started: float, extra: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"step_ends": step_ends, "started": started, "peak_rss_bytes": peak_rss_bytes(), "pid": os.getpid()}
    out.write_text(json.dumps({**record, **extra}))


class ProbedRegression(RegressionModule):
    """``RegressionModule`` that, every ``every``-th batch, logs its loss with ``sync_dist=True`` inside the training
    step (a reduction over the whole job while the step's quorum is open: the cross-group collective's latency) and
    records how long that took."""

    def __init__(self, size: str, every: int, timings: dict[str, list[float]]) -> None:
        super().__init__(size)
        self.every, self.timings = every, timings

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx % self.every == self.every - 1:
            started = time.perf_counter()
            self.log("probe", loss.detach(), sync_dist=True, on_step=True, on_epoch=False)
            self.timings["in_step"].append(time.perf_counter() - started)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """A validation run as users write one: the loss logged per epoch with ``sync_dist=True``, reduced over the
        whole job at the run's end (in ``FTStrategy`` inside a sync section, with its own quorum)."""
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)


def run_lightning(args: argparse.Namespace, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_ft import FTStrategy

    size = SIZES[args.size]
    step_ends: list[float] = []

    quorum_wait = [0.0]
    waits: list[float] = []
    refetches = [0]

    timings: dict[str, list[float]] = {"in_step": [], "section": [], "validation": []}

    class StepClock(pl.Callback):
        def on_validation_start(self, *_: Any) -> None:
            timings["validation_started"] = [time.perf_counter()]

        def on_validation_end(self, *_: Any) -> None:
            timings["validation"].append(time.perf_counter() - timings["validation_started"][0])

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            step_ends.append(time.perf_counter())
            if args.probe_every and len(step_ends) % args.probe_every == 0:
                # A reduction between steps: in FTStrategy a sync section (its own quorum, then the exchange), what
                # a validation run's sync_dist metrics pay; in DDPStrategy an allreduce of the world.
                started = time.perf_counter()
                trainer.strategy.reduce(torch.ones(1), reduce_op="sum")
                timings["section"].append(time.perf_counter() - started)
            if isinstance(trainer.strategy, FTStrategy):
                quorum_wait[0] = trainer.strategy.telemetry.quorum_wait_seconds_total
                waits.append(quorum_wait[0])
                data = trainer.strategy.exactly_once_data
                refetches[0] = data.refetches if data is not None else 0

    if args.mode == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo", **json.loads(args.ddp_args))
        devices = world = args.processes
    else:
        strategy = FTStrategy(**json.loads(args.ft_args))
        devices, world = 1, int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    data = SyntheticRegression(size.width, size.batch_size, length=args.steps * size.batch_size * world)
    validation: dict[str, Any] = {"limit_val_batches": 0}
    if args.probe_every:  # a validation run of VALIDATION_BATCHES batches every probe_every steps
        validation = {"val_check_interval": args.probe_every, "limit_val_batches": VALIDATION_BATCHES}
    trainer = pl.Trainer(
        **validation,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.root,
        callbacks=[StepClock()],
    )
    started = time.perf_counter()
    module = ProbedRegression(args.size, args.probe_every, timings) if args.probe_every else RegressionModule(args.size)
    val_data = SyntheticRegression(size.width, size.batch_size, length=VALIDATION_BATCHES * size.batch_size * world)
    val_loader = DataLoader(val_data, batch_size=size.batch_size) if args.probe_every else None
    trainer.fit(module, DataLoader(data, batch_size=size.batch_size), val_loader)
    # Every process of every mode writes its own record (ddp: both ranks; ft: both groups), so that overhead.py
    # averages the same two processes in each mode. Until 2026-11-26 ddp wrote rank 0's alone.
    rank = trainer.global_rank if args.mode == "ddp" else int(os.environ.get("REPLICA_GROUP_ID", "0"))
    extra: dict[str, Any] = {"global_step": trainer.global_step}
    if args.probe_every:
        extra["probe_in_step_s"], extra["probe_section_s"] = timings["in_step"], timings["section"]
        extra["probe_validation_s"] = timings["validation"]
    if args.mode == "ft":  # where the training thread waited for the quorum (strategy.telemetry, the ft/ metrics)
        extra["quorum_wait_s_total"] = quorum_wait[0]
        extra["quorum_wait_s_by_step"] = waits
        extra["refetches"] = refetches[0]
    write(out.with_name(f"{out.stem}.{rank}.json"), step_ends, started, extra)


def run_torchft(args: argparse.Namespace, out: Path) -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    size = SIZES[args.size]
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    model = size.build()
    manager = raw_torchft_manager(
        f"bench_torchft_{group}",
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optim"])),
    )
    model = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters(), lr=1e-4))
    data = SyntheticRegression(size.width, size.batch_size, length=args.steps * size.batch_size * groups)
    sampler = DistributedSampler(data, num_replicas=groups, rank=group, shuffle=False)
    step_ends: list[float] = []
    started = time.perf_counter()
    for inputs, targets in DataLoader(data, batch_size=size.batch_size, sampler=sampler):
        if manager.current_step() >= args.steps:
            break
        optimizer.zero_grad()  # starts the quorum
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()  # should_commit, then step
        step_ends.append(time.perf_counter())
    write(out.with_name(f"{out.stem}.{group}.json"), step_ends, started, {"global_step": manager.current_step()})
    manager.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "ft", "torchft"], required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--processes", type=int, default=2, help="--mode ddp: the torchrun world's size")
    parser.add_argument("--ft-args", default="{}", help="--mode ft: FTStrategy keyword arguments, as JSON")
    parser.add_argument("--ddp-args", default="{}", help="--mode ddp: more DDPStrategy keyword arguments, as JSON")
    parser.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="every N steps, time a job-wide reduction in the step, one between steps and a validation run",
    )
    args = parser.parse_args()
    run = run_torchft if args.mode == "torchft" else run_lightning
    profile_to = os.environ.get("BENCH_PROFILE")  # a directory: where to find the per-step costs (cProfile)
    if not profile_to:
        run(args, args.out)
        return
    import cProfile

    group = os.environ.get("REPLICA_GROUP_ID", os.environ.get("RANK", "0"))
    cProfile.runctx("run(args, args.out)", globals(), locals(), f"{profile_to}/{args.mode}.{group}.prof")


if __name__ == "__main__":
    main()

"""One host-device sync per committed step: the one torchft's vote takes. FTStrategy adds no other device read.

On an accelerator every read of a device tensor on the host (``.item()``, ``bool()``, ``float()``, ``.tolist()``,
``.cpu()``, ``.numpy()``) waits for the kernels queued before it. One read after the optimizer's launches makes the
host wait for the optimizer before it can queue the next batch, and the accelerator idles meanwhile
(``docs/benchmarks.md``, *One sync per step*). torchft's ``Manager.should_commit`` synchronizes the device once per
step, on purpose; whatever FTStrategy must read for the step is read inside that call, after the sync, where it
waits for nothing (:mod:`lightning_ft.manager.vote_inputs`).

This runs on CPU: a ``TorchFunctionMode`` on the training thread sees every such read whatever the device, and the
same fit under Lightning's ``DDPStrategy`` says which reads are Lightning's and torch's own (the loggers', AdamW's
step count). What FTStrategy adds beyond them, outside the vote, must be nothing.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, loader, trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.overrides import TorchFunctionMode

from lightning_ft import FTStrategy, ReplicaConsistencyCheck
from lightning_ft_job.events import ENV_EVENTS_DIR

pytestmark = pytest.mark.timeout(180)

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
FIRST_COUNTED_BATCH = 3  # after the first steps' one-time work (bucket layout, the first quorum, the data check)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors on this thread, by call site, apart from those inside torchft's vote."""

    def __init__(self) -> None:
        super().__init__()
        self.outside_vote: collections.Counter[str] = collections.Counter()
        self.inside_vote = 0
        self.votes = 0
        self.in_vote = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            if self.in_vote:
                self.inside_vote += 1
            else:
                caller = traceback.extract_stack(limit=3)[0]
                self.outside_vote[f"{func.__name__} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


class CountFromBatch(pl.Callback):
    """Turns the counting on from a batch on, and marks torchft's vote (FTStrategy only)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.counting = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        manager = getattr(trainer.strategy, "manager", None)
        if manager is None:
            return
        should_commit, reads = manager.should_commit, self.reads

        def vote(*args: Any, **kwargs: Any) -> bool:
            reads.votes += 1
            reads.in_vote = True
            try:
                return should_commit(*args, **kwargs)
            finally:
                reads.in_vote = False

        manager.should_commit = vote

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        if index == FIRST_COUNTED_BATCH and not self.counting:
            self.counting = True
            self.reads.__enter__()
            self.reads.votes = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.counting:
            self.counting = False
            self.reads.__exit__(None, None, None)


class LoggingRegressor(Regressor):
    """Logs its loss to the loggers and the progress bar every step, as most users' models do."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class NoConsistencyCheck(ReplicaConsistencyCheck):
    """In place of FTStrategy's default check, which reads its fingerprints every N steps and at the last one: not a
    per-step cost (``benchmarks/heal/state_check_cost.py`` measures it)."""

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        pass


def count_host_reads(strategy: Any, tmp_path: Path, steps: int, **trainer_kwargs: Any) -> HostReads:
    reads = HostReads()
    run = trainer(
        strategy,
        callbacks=[CountFromBatch(reads), NoConsistencyCheck()],
        max_steps=steps,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=True,
        **trainer_kwargs,
    )
    run.fit(LoggingRegressor(), loader())
    assert run.global_step == steps
    return reads


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fault_tolerance_adds_no_host_read_to_a_step_beyond_the_votes_own_sync(tmp_path, monkeypatch, accumulate):
    """The event log on (its step events carry the loss), the ``ft/`` metrics and ``replicas P/N`` in the progress
    bar, a logged loss, and the non-finite check of every averaged gradient: every read FTStrategy makes happens
    inside torchft's vote, which runs once per counted step. Fails when the step event's loss is read at batch end
    (``float(loss.detach())``, the second sync measured on a GPU) or the non-finite flag before the vote."""
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "events"))
    steps = 12
    counted_steps = steps - FIRST_COUNTED_BATCH // accumulate
    ft = count_host_reads(FTStrategy(), tmp_path / "ft", steps, accumulate_grad_batches=accumulate)
    ddp = count_host_reads(DDPStrategy(), tmp_path / "ddp", steps, accumulate_grad_batches=accumulate)

    assert sum(ddp.outside_vote.values()) > 0, "the counter saw none of Lightning's own reads: it counts nothing"
    added = ft.outside_vote - ddp.outside_vote
    assert not added, f"host reads FTStrategy adds outside the vote's sync: {dict(added)}"
    assert ft.votes == counted_steps, "one vote (and so one device sync) per committed step"
    assert ft.inside_vote == 2 * counted_steps, "the non-finite flag and the loss, read after the vote's sync"
    events = [line for path in (tmp_path / "events").rglob("*.jsonl") for line in path.read_text().splitlines()]
    assert sum('"event": "step"' in line and '"loss": ' in line for line in events) == steps

"""On a GPU the vote waits for the step's cross-group work and its own inputs, not for the clipping queued after them.

On the CPU (no stream to fence) a recording stand-in takes the fence's place in a real fit: the step owner marks the
fence at the end of each backward pass whose gradients crossed groups, after the vote's inputs are queued, and each
vote uses the mark once; a step whose averaged gradient is not finite is still rejected through the inputs queued
there. On a GPU the fence is the real one, on real streams, with the sync torchft's vote makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, cuda_only, keep_gpu_busy, loader, trainer
from lightning.pytorch.plugins.precision import Precision

from lightning_ft.manager.vote_fence import VoteFence
from lightning_ft.step.protocol import StepProtocol

pytestmark = pytest.mark.timeout(180)


class RecordingFence:
    """:class:`VoteFence`'s interface on the CPU: records each mark (were the vote's inputs queued by then?) and
    each vote (was there a mark to wait for?)."""

    def __init__(self, protocol: StepProtocol) -> None:
        self.protocol = protocol
        self.log: list[tuple[str, bool]] = []
        self.marked = False

    def mark(self) -> None:
        self.log.append(("mark", self.protocol.vote_inputs_queued))
        self.marked = True

    def clear(self) -> None:
        self.marked = False

    @contextmanager
    def voting(self) -> Iterator[None]:
        self.log.append(("vote", self.marked))
        self.marked = False
        yield


class InstallFence(pl.Callback):
    def __init__(self) -> None:
        self.fence: RecordingFence | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        protocol = trainer.strategy.step_protocol  # type: ignore[attr-defined]
        assert protocol.vote_fence is None  # the CPU: no fence of its own
        fence = self.fence = RecordingFence(protocol)
        protocol.vote_fence = fence
        read_at_vote = protocol.read_at_vote

        def logged_read(*args: Any, **kwargs: Any) -> None:
            fence.log.append(("read", True))
            read_at_vote(*args, **kwargs)

        protocol.read_at_vote = logged_read


class ScalingPrecision(Precision):
    """Scales the loss before the backward pass, as a GradScaler does: the loss the vote reads must be the unscaled
    one."""

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        return super().pre_backward(tensor * 1024.0, module)


class StepLosses(pl.Callback):
    """Each committed step's loss as the vote read it, beside the loss the training step returned."""

    def __init__(self) -> None:
        self.pairs: list[tuple[float | None, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        protocol = trainer.strategy.step_protocol  # type: ignore[attr-defined]
        if protocol.last_step_committed:
            self.pairs.append((protocol.step_loss, float(outputs["loss"])))


class NaNAt(Regressor):
    """Its loss, and so its averaged gradient, is NaN at one batch."""

    def __init__(self, batch: int) -> None:
        super().__init__(scheduler=False)
        self.nan_batch = batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == self.nan_batch else loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_vote_waits_for_the_mark_made_after_its_inputs_were_queued(accumulate: int) -> None:
    """Fails when the owner marks before queuing the inputs (a mark logged with ``False``), when the inputs are read
    again after the mark (queued after clipping, the fenced sync would not wait for their copies), when a vote finds
    no mark, when the NaN step is not rejected, or when the loss read is the one scaled for the backward pass."""
    steps, install, losses = 6, InstallFence(), StepLosses()
    fit = trainer(
        callbacks=[install, losses], max_steps=steps, accumulate_grad_batches=accumulate, plugins=[ScalingPrecision()]
    )
    nan_batch = 2 * accumulate + accumulate - 1  # the last micro-batch of the third step
    fit.fit(NaNAt(nan_batch), loader())
    assert install.fence is not None
    log = install.fence.log
    votes = steps + 1  # one rejected
    assert log == [("read", True), ("mark", True), ("vote", True)] * votes
    assert fit.global_step == steps
    assert install.fence.protocol.non_finite_skips == 1
    if accumulate == 1:  # the loss read at the vote is the one the step returned, not the scaled one
        assert len(losses.pairs) == steps
        assert all(read == pytest.approx(returned) for read, returned in losses.pairs), losses.pairs


@cuda_only
def test_on_a_gpu_the_votes_sync_returns_at_the_mark_while_later_kernels_run() -> None:
    """torchft's vote syncs the current stream (``torchft.utils.synchronize``): inside ``voting()`` that returns once
    the work before the mark is done, with the work after it still running. Fails if the side stream is not current
    (the sync would wait for the 2-s kernel) or does not wait for the mark."""
    from torchft.utils import synchronize

    device = torch.device("cuda")
    fence = VoteFence(device)
    keep_gpu_busy(0.2)  # the step's cross-group work
    before = torch.cuda.Event()
    before.record()
    fence.mark()
    keep_gpu_busy(2.0)  # clipping, queued after the mark
    after = torch.cuda.Event()
    after.record()
    with fence.voting():
        synchronize()
        assert before.query(), "the vote's sync returned before the marked work was done"
        assert not after.query(), "the vote's sync waited for the work queued after the mark"
    torch.cuda.synchronize()
    assert fence.votes_fenced == 1 and not fence.marked


@cuda_only
def test_on_a_gpu_what_the_vote_queues_comes_before_the_update() -> None:
    """Work queued inside the vote (on the side stream) is ordered before the default stream's next kernel. Fails
    if the default stream does not wait for the side stream when the vote ends."""
    device = torch.device("cuda")
    fence = VoteFence(device)
    value = torch.zeros(1, device=device)
    fence.mark()
    with fence.voting():
        keep_gpu_busy(0.5)
        value.fill_(1.0)
    doubled = value * 2  # the optimizer's update, on the default stream
    assert doubled.item() == 2.0


@cuda_only
def test_on_a_gpu_without_a_mark_the_vote_waits_for_everything() -> None:
    device = torch.device("cuda")
    fence = VoteFence(device)
    fence.mark()
    fence.clear()
    keep_gpu_busy(0.5)
    after = torch.cuda.Event()
    after.record()
    with fence.voting():
        torch.cuda.current_stream().synchronize()
        assert after.query()
    assert fence.votes_fenced == 0

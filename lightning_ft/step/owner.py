"""The one owner of an optimizer step in Lightning's training loop: :class:`StepOwner`.

:class:`~lightning_ft.step.protocol.StepProtocol` is the step's exchange with the torchft Manager (quorum, vote,
close); this module is where Lightning's loop meets it. Every point of one optimizer step is a method here, and each
is called from one place that does not depend on the order of the trainer's callbacks:

========================  ==========================================================================================
:meth:`StepOwner.begin`    the step's quorum opens (a behind group heals here with synchronous quorum) and Lightning's
                           step counters are put on the committed count. Called by the first of: the exactly-once
                           batch check (``FTStrategy.batch_to_device``), ``QuorumCallback.on_train_batch_start``,
                           ``FTStrategy.on_train_batch_start`` (which Lightning calls after every callback's).
:meth:`StepOwner.step`     the optimizer: the closure runs, the vote is taken once, the real optimizer steps only on a
                           commit (``FTStrategy.optimizer_step``).
:meth:`StepOwner.end`      the step closes after the batch's work and before any ``on_train_batch_end`` hook: the
                           ``step`` event, the group's ranks re-aligned after the job's first commit, the counters
                           put on the committed count. Then the step-interval LR schedulers advance, only on a commit
                           (:meth:`StepOwner.advances_schedulers`). Both run in the epoch loop's post-batch scheduler
                           update (:func:`lightning_ft.loop_patches.settle_each_step`).
========================  ==========================================================================================

Callbacks read the step through the protocol's read-only properties (``quorum_open``, ``decided``,
``last_step_committed``) and observe its start with :meth:`StepProtocol.on_step_start`; none of them writes it.
Semi-synchronous training (LocalSGD, DiLoCo) has the other owner,
:class:`~lightning_ft.algorithms.sync_owner.SyncOwner`: its optimizer steps are the group's own, and its syncs begin
and end there. A fit has exactly one of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ft.heal.state import align_logger_step, align_step_counters, realign_after_the_first_commit
from lightning_ft.step.gated_optimizer import CommitGatedOptimizer
from lightning_ft.step.gradient_hooks import FTCommState
from lightning_ft.step.protocol import StepProtocol
from lightning_ft_job import events


def loss_of(outputs: Any) -> float | None:
    """The training loss of a batch from what ``training_step`` returned (``{"loss": ...}`` or a scalar tensor)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return float(loss.detach())
    return None


class StepOwner:
    """Drives one optimizer step per accumulation window through the step protocol, from Lightning's loop.

    Args:
        protocol: The fit's step protocol (the Manager's quorum and vote).
        skip_non_finite: Every replica skips a step whose averaged gradient has an inf or NaN
            (``FTStrategy(skip_non_finite_steps=...)``).
        sharded: Each rank of the group holds a shard of the state (FSDP2), not a replica of all of it.
    """

    def __init__(self, protocol: StepProtocol, *, skip_non_finite: bool, sharded: bool = False) -> None:
        self._protocol = protocol
        self._skip_non_finite = skip_non_finite
        self._sharded = sharded
        self._output: Any = None  # what the batch's training_step returned: the step event's loss, if not read at vote
        self._collectives: int | None = None  # the step's cross-group gradient collectives (DDP's hook), for the event

    @property
    def protocol(self) -> StepProtocol:
        return self._protocol

    def begin(self, trainer: pl.Trainer) -> None:
        """Open the step's quorum unless it is open (accumulation micro-batches share it) and put ``global_step`` and
        the logger's step on the committed count. With synchronous quorum a behind group heals in here, before its
        forward pass."""
        self._protocol.open_quorum()
        committed = self._protocol.manager.current_step()
        align_step_counters(trainer, committed)
        align_logger_step(trainer, committed)

    def saw_output(self, output: Any) -> None:
        """Keep what ``training_step`` returned: the ``step`` event's loss when the vote read none (manual
        optimization, a loss that is not a scalar tensor)."""
        self._output = output

    def backward_done(self, loss: Tensor, comm_state: FTCommState | None) -> None:
        """A backward pass of automatic optimization ended (``FTStrategy.backward``; ``loss`` as it was given, not as
        a GradScaler scaled it). On a GPU with a vote fence, if its gradients crossed groups: queue the vote's inputs
        (the averaged gradient's non-finite check, the loss) and mark the fence, before clipping and
        ``on_before_optimizer_step`` queue their kernels, so that the vote waits for the cross-group work only
        (:mod:`lightning_ft.manager.vote_fence`). An accumulating micro-batch (no bucket averaged) or a backward pass
        after the vote marks nothing."""
        protocol = self._protocol
        fence = protocol.vote_fence
        if fence is None or comm_state is None or not protocol.quorum_open or protocol.decided:
            return
        check = comm_state.take_gradient_check()
        if check is None:
            return
        protocol.read_at_vote(
            finite=check if self._skip_non_finite else None,
            loss=loss if isinstance(loss, Tensor) and loss.numel() == 1 else None,
        )
        fence.mark()

    def step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module,
        precision_plugin: Precision,
        comm_state: FTCommState | None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure through the precision plugin, take the vote, and step the optimizer only on a commit.

        GradScaler may skip ``optimizer.step()`` on inf/NaN gradients; the vote is still taken, because every rank
        of the group takes part in it exactly once per step.
        """
        protocol = self._protocol
        gated = CommitGatedOptimizer(
            optimizer,
            protocol,
            skip_non_finite=self._skip_non_finite,
            gradient_check=comm_state.take_gradient_check if comm_state is not None else None,
            reduction_check=comm_state.check_reduction_finished if comm_state is not None else None,
        )
        try:
            output = precision_plugin.optimizer_step(gated, model=model, closure=closure, **kwargs)  # type: ignore[arg-type]  # a view with the optimizer's attributes
        finally:
            if comm_state is not None:  # a step that never reached the gate (GradScaler skipped it) leaves a check
                comm_state.take_gradient_check()
                self._collectives = comm_state.take_collective_count()
        if not protocol.decided:  # GradScaler skipped the optimizer: the vote is still taken, and checked alike
            if comm_state is not None:
                comm_state.check_reduction_finished()
            protocol.commit()
        return output

    def end(self, trainer: pl.Trainer) -> None:
        """Close the step whose vote this batch took, before any ``on_train_batch_end`` hook runs: callbacks, the
        LightningModule and ``ModelCheckpoint`` see ``global_step`` on the committed count. A micro-batch that did
        not vote (gradient accumulation) leaves the quorum open for the next one."""
        protocol = self._protocol
        manager = protocol.manager
        committed = manager.current_step()
        if protocol.decided:
            if events.enabled():  # the loss is read for the event only (on a GPU, a read is a device sync)
                loss = protocol.step_loss if protocol.step_loss is not None else loss_of(self._output)
                collectives = {} if self._collectives is None else {"cross_group_collectives": self._collectives}
                protocol.report_step(protocol.last_step_committed, loss=loss, **collectives)
            realign_after_the_first_commit(trainer, protocol.last_step_committed, committed, sharded=self._sharded)
        protocol.close()
        self._output = None
        self._collectives = None
        align_step_counters(trainer, committed)

    def advances_schedulers(self) -> bool:
        """Whether step-interval LR schedulers advance after this batch: not after a step the vote rejected."""
        return self._protocol.last_step_committed is not False

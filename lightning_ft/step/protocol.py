"""The per-step protocol with the torchft Manager: one quorum, one commit vote, per optimizer step.

torchft's own ``torchft.Optimizer`` cannot be used under Lightning: it asserts that ``step()`` gets no closure
(Lightning always passes one), and it starts the quorum in ``zero_grad()``, which Lightning calls after the forward
pass and only on accumulation boundaries. This module keeps the same protocol in a shape Lightning can drive:

* :meth:`StepProtocol.open_quorum` at the first micro-batch of an optimizer step (idempotent while accumulating);
* :meth:`StepProtocol.commit` once per step, after backward and the cross-group allreduce: the buffers' average
  (:mod:`lightning_ft.step.buffers`), then torchft's ``should_commit()`` vote, then the buffers settle on its outcome.
  The vote's device sync is the step's only one: whether the averaged gradient is finite and the step's loss are read
  right after it (:meth:`StepProtocol.read_at_vote`). With manual optimization every optimizer of a batch shares the
  one decision;
* :meth:`StepProtocol.close` when the batch that took the decision ends, so the next batch opens a new quorum.

:class:`CommitGatedOptimizer` is the optimizer handed to Lightning's precision plugin. It lets the plugin run the
closure (forward, backward, ``on_before_optimizer_step``, clipping, GradScaler unscaling) exactly as usual, and only
steps the real optimizer when the vote says the step is committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torch import Tensor
from torchft import Manager

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.internals import (
    abort_cross_group_process_group,
    manager_client,
    set_aside_if_left_behind,
)
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.manager.vote_fence import VoteFence
from lightning_ft.manager.vote_inputs import VoteInputs, host_copy, should_commit_reading
from lightning_ft.step.buffers import ModelBuffers
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")


class JobBehindCheckpointError(LightningFTError, RuntimeError):
    """The groups of this group's first quorum are behind a step the job had already reached (its newest checkpoint,
    or its last quorum's step when it keeps no checkpoint)."""


class FailedAfterCommitError(LightningFTError, RuntimeError):
    """A cross-group collective failed after the step's commit decision: the group stops (and restarts and heals)
    rather than stay silently different from its peers."""


class QuorumNotStartedError(LightningFTError, RuntimeError):
    """Gradients were about to cross groups without a quorum for this step."""


class StepProtocol:
    """Tracks where the current optimizer step is in the quorum → allreduce → commit sequence.

    Args:
        manager: The group's torchft Manager.
        telemetry: Told when a step opens its quorum and how each vote went, for the ``ft/`` metrics. Optional, so
            that the protocol works on its own.
        buffers: The model's buffers, averaged across groups at each vote (:mod:`lightning_ft.step.buffers`);
            ``None`` leaves them to each replica (``FTStrategy(buffer_sync="off")``).
    """

    def __init__(
        self, manager: Manager, telemetry: FTTelemetry | None = None, buffers: ModelBuffers | None = None
    ) -> None:
        self.manager = manager
        self.telemetry = telemetry
        self.buffers = buffers
        self._quorum_open = False
        self._decision: bool | None = None
        self._last_committed: bool | None = None
        self._quorums_opened = 0
        self._sync_in_flight = False
        self._non_finite_skips = 0
        self._step_start_observers: list[Callable[[], None]] = []
        # A step the job had already reached (its newest checkpoint, lightning_ft.start.decision), which this process's
        # first quorum must reach, and where that step is from.
        self._floor_step: int | None = None
        self._floor_source = "the job's newest checkpoint"
        # What the open step's vote reads from the device after torchft's sync (read_at_vote), and the loss read.
        self._finite_at_vote: Callable[[], bool] | None = None
        self._loss_at_vote: Tensor | None = None
        self._inputs_queued = False
        self.step_loss: float | None = None
        # On a GPU with the DDP hook on NCCL: what the vote waits for instead of the whole stream (set by the hook's
        # installation; lightning_ft.manager.vote_fence). Marked by the step owner at the end of the backward pass.
        self.vote_fence: VoteFence | None = None

    @property
    def quorum_open(self) -> bool:
        """Whether an optimizer step's quorum is open (from its first micro-batch until the deciding batch ends)."""
        return self._quorum_open

    @property
    def in_step(self) -> bool:
        """Whether the open quorum belongs to the work being done right now: an optimizer step between its quorum and
        its vote, or a semi-synchronous sync. ``False`` in the inner steps that a streaming DiLoCo sync overlaps
        (``sync_in_flight``): its quorum stays open while they train, but they are the group's own work, so their
        collectives stay inside the group."""
        return self._quorum_open and not self.sync_in_flight

    @property
    def decided(self) -> bool:
        """Whether the open step's vote has been taken."""
        return self._decision is not None

    @property
    def last_step_committed(self) -> bool | None:
        """The latest vote's outcome (``None`` before the first), kept after the step closes: what the scheduler gate
        and the callbacks read at the batch's end."""
        return self._last_committed

    @property
    def quorums_opened(self) -> int:
        """Quorums this process opened for steps or syncs (``0`` until its first: where a restarted group joins)."""
        return self._quorums_opened

    @property
    def non_finite_skips(self) -> int:
        """Steps rejected because their averaged gradient was not finite."""
        return self._non_finite_skips

    @property
    def sync_in_flight(self) -> bool:
        """Whether a streaming DiLoCo sync's allreduce overlaps the inner steps now running (see :attr:`in_step`)."""
        return self._sync_in_flight

    @property
    def floor_step(self) -> int | None:
        """The step this process's first quorum must reach (:meth:`require_floor`), until a quorum reached it."""
        return self._floor_step

    def require_floor(self, step: int | None, source: str | None = None) -> None:
        """Make this process's first quorum stop the group (:class:`JobBehindCheckpointError`) if its groups are
        behind ``step``, a step the job had already reached; ``source`` says where that step is from, for the
        message. Set by :mod:`lightning_ft.start.lifecycle` before the fit's first batch."""
        self._floor_step = step
        if source:
            self._floor_source = source

    def on_step_start(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` each time a step (or sync) is about to open its quorum, before anything of the step
        happens: where a group's loop position at the start of a step is taken
        (:class:`~lightning_ft.callbacks.DataPositionCallback`), whichever code opens the quorum."""
        self._step_start_observers.append(observer)

    def check_before_vote(self, check: Callable[[Manager], bool]) -> None:
        """Call ``check(manager)`` at every vote, a step's or a sync's (torchft's own inside DiLoCo), in every rank
        of the group alike (it may broadcast inside the group). ``False`` votes not to commit, with the error it
        reported to the Manager; it may raise to stop the group. Where the job's last step is checked
        (:mod:`lightning_ft.start.last_step`). The check lives in the Manager's :class:`VoteInputs` client, which
        every Manager lightning-ft builds has; a Manager built by hand without it is not checked."""
        client = manager_client(self.manager)
        if isinstance(client, VoteInputs):
            client.check_each_vote(lambda: check(self.manager))

    def begin_overlapped_sync(self) -> None:
        """A streaming DiLoCo sync's allreduce is in flight: its quorum stays open while the next inner steps, the
        group's own work, train (:attr:`in_step` is ``False`` until :meth:`end_overlapped_sync`)."""
        self._sync_in_flight = True

    def end_overlapped_sync(self) -> None:
        self._sync_in_flight = False

    def open_quorum(self) -> None:
        """Start this step's quorum unless one is already open (accumulation micro-batches share it).

        With synchronous quorum a behind replica heals inside this call, before its forward pass.
        """
        if self._quorum_open:
            return
        for observer in self._step_start_observers:
            observer()
        if not self._quorums_opened:  # this process's first quorum: where a restarted or late group asks to join
            events.emit("joining", step=self.manager.current_step())
        if self.telemetry is not None:
            self.telemetry.step_started()
        if self.buffers is not None:  # before the quorum: a peer healing in it is sent the committed buffers
            self.buffers.begin_step()
        self.manager.start_quorum()
        self._quorum_open = True
        self._quorums_opened += 1
        self._decision = None
        self._finite_at_vote, self._loss_at_vote, self.step_loss = None, None, None
        self._inputs_queued = False
        if self.vote_fence is not None:
            self.vote_fence.clear()
        if self._floor_step is not None:
            self._check_floor(self._floor_step)

    def _check_floor(self, floor_step: int) -> None:
        """Stop rather than take the job back: this quorum's groups (healed to the highest step among them) must be
        at or past the job's newest checkpoint. Only until the first quorum that is; it waits for an asynchronous
        quorum, so it costs the overlap of one step."""
        self.manager.wait_quorum()
        step = self.manager.current_step()
        if step >= floor_step:
            self._floor_step = None
            return
        if self.manager.errored() is not None:  # the heal failed; this step will not commit, the next one checks
            return
        events.emit("behind_checkpoint", step=step, checkpoint_step=floor_step)
        raise JobBehindCheckpointError(
            f"lightning-ft: the replica groups of this quorum are at committed step {step}, behind step {floor_step} "
            f"that the job had already reached ({self._floor_source}): the live peer this group expected to heal from "
            f"is gone. Stopping so that this group's restart resumes the job from its newest durable state (or stops "
            f"if it has none) instead of training the job from an older state."
        )

    def require_quorum(self) -> None:
        if not self._quorum_open:
            raise QuorumNotStartedError(
                "lightning-ft: gradients reached the cross-group allreduce but no quorum was started for this step. "
                "The step's owner begins each step at its training batch's start (QuorumCallback, or the "
                "strategy's own on_train_batch_start); code that runs a step outside Lightning's training loop "
                "begins it through the owner: trainer.strategy.start_quorum() at the first micro-batch of each "
                "optimizer step (per-step training; a semi-synchronous sync opens its own quorum)."
            )

    def before_cross_group_allreduce(self) -> None:
        """Called by the gradient hooks before each cross-group allreduce of the backward pass: the quorum must be
        open, and the first one starts the buffers' average (every forward pass of the step is done by then), so that
        it overlaps the rest of the backward pass. Not after the vote (a manual-optimization backward pass that
        follows the decision): a step averages its buffers once."""
        self.require_quorum()
        if self.buffers is not None and self._decision is None and not self.buffers.at_batch_end:
            self.buffers.start_average()

    def commit(self) -> bool:
        """torchft's commit vote, taken once per step. Later calls in the same batch reuse the decision.

        A cross-group collective that fails *after* a positive decision (manual optimization with several
        optimizers) would leave this replica silently different from its peers, so it is turned into a crash:
        the group restarts and heals from a live peer.
        """
        if self._decision is not None:
            self._stop_if_failed_after_commit()
            return self._decision
        self.require_quorum()
        buffers = self.buffers if self.buffers is not None and not self.buffers.at_batch_end else None
        if buffers is not None:
            buffers.average()
        self._abort_failed_process_group()
        decision = self._vote()
        self._record(decision)
        if buffers is not None:  # after the vote, which may have healed this replica's buffers
            buffers.settle(decision)
        return decision

    @property
    def vote_inputs_queued(self) -> bool:
        """Whether the open step's vote inputs are queued for the host already (:meth:`read_at_vote`)."""
        return self._inputs_queued

    def read_at_vote(self, finite: Callable[[], bool] | None = None, loss: Tensor | None = None) -> None:
        """What this step's vote reads from the device: ``finite()`` says whether the averaged gradient is finite
        (a ``False`` rejects the step in every group alike), and ``loss`` becomes :attr:`step_loss`. Both are read
        once torchft's vote has synchronized the device, so that the step has one host-device sync
        (:mod:`lightning_ft.manager.vote_inputs`)."""
        self._finite_at_vote = finite
        self._loss_at_vote = host_copy(loss) if loss is not None else None
        self._inputs_queued = True

    def _vote(self) -> bool:
        """torchft's vote, reading this process's inputs after its sync. The sync waits for the vote fence's mark
        only while this replica takes part in the step: a healing one has its received state applied inside the
        vote. (The buffers' average, started at the backward pass's first bucket, is on the NCCL stream before the
        last bucket, so the mark covers it too.)"""
        fence = self.vote_fence
        if fence is not None and not self.manager.is_participating():
            fence.clear()
        with fence.voting() if fence is not None else nullcontext():
            if self._finite_at_vote is None and self._loss_at_vote is None:
                return self.manager.should_commit()
            return should_commit_reading(self.manager, self._read_at_vote)

    def _read_at_vote(self, voting_to_commit: bool) -> bool:
        finite, loss = self._finite_at_vote, self._loss_at_vote
        self._finite_at_vote, self._loss_at_vote = None, None
        if loss is not None:
            self.step_loss = float(loss)
        if voting_to_commit and finite is not None and not finite():  # garbage after an error: not read then
            self.reject(NonFiniteGradientError(self.manager.current_step()))
            return False
        return voting_to_commit

    def _stop_if_failed_after_commit(self) -> None:
        if self._decision and self.manager.errored() is not None:
            raise FailedAfterCommitError(
                "lightning-ft: a cross-group collective failed after this batch's commit decision. Stopping this "
                "replica group so that it restarts and heals instead of diverging from its peers."
            ) from self.manager.errored().original_exception

    def _abort_failed_process_group(self) -> None:
        """After a failed cross-group collective, abort the process group before the vote, closing its connections.

        Why: when a group dies mid-allreduce, the survivor that fails first goes on to the next quorum, but another
        survivor may still be waiting in the same collective on its pair with *that* survivor, which gave up without
        closing it. The lighthouse would then wait its join timeout (10 s with ``lightning-ft launch``) for the
        waiting survivor, which only fails once the first one reconfigures. Aborting here makes it fail at once.

        Safe because the process group is rebuilt before it is used again: a step that does not commit makes the
        lighthouse hand out a new quorum id, and a new quorum id reconfigures the process group (until then torchft's
        ``allreduce`` is a no-op, the step having errored). A step rejected for a non-finite gradient leaves the
        process group alone: every collective of it succeeded. A process group with an operation that was given up
        (:mod:`lightning_ft.process_group.left_behind`) is set aside instead: Gloo's abort would block until it ends.
        """
        error = self.manager.errored()
        if error is None or isinstance(error.original_exception, NonFiniteGradientError):
            return
        if set_aside_if_left_behind(self.manager):  # an operation is still pending in Gloo, which aborting waits for
            return
        try:
            aborted = abort_cross_group_process_group(self.manager)
        except Exception as abort_error:  # the vote must still happen; the next quorum rebuilds the group anyway
            log.warning("lightning-ft: aborting the failed cross-group process group failed: %r", abort_error)
        else:
            if aborted:
                events.emit("process_group_aborted", step=self.manager.current_step())

    def reject(self, reason: Exception) -> None:
        """Make this group vote against committing the open step, for a reason every replica shares (an averaged
        gradient that is not finite): every group then skips the step alike. Counted and logged."""
        self.require_quorum()
        self._non_finite_skips += 1
        self.manager.report_error(reason)
        events.emit("step_rejected", step=self.manager.current_step(), reason=str(reason))
        log.warning("%s", reason)

    def record_commit(self, decision: bool) -> None:
        """Record a vote that torchft took itself (a DiLoCo fragment's ``perform_sync`` calls ``should_commit``)."""
        self.require_quorum()
        self._record(decision)

    def _record(self, decision: bool) -> None:
        self._decision = decision
        self._last_committed = decision
        if self.telemetry is not None:
            self.telemetry.step_voted(decision)

    def report_step(self, committed: bool | None, **details: Any) -> None:
        """The ``step`` event of a decided step or sync, its one definition: the Manager's committed step, the
        decision, the participants, the error that failed it (if any), and what the owner adds (``details``)."""
        if not events.enabled():
            return
        error = self.manager.errored()
        failure = {"error": repr(error.original_exception)} if error is not None else {}
        participants = self.manager.num_participants()
        step = self.manager.current_step()
        events.emit("step", step=step, committed=committed, participants=participants, **failure, **details)

    def release(self) -> None:
        """End an open quorum without a vote: it only had to find out who is there (every group then knows it is
        where the others are), nothing was exchanged, nothing is to commit."""
        self._quorum_open = False
        self._decision = None
        self._sync_in_flight = False

    def close(self) -> None:
        """End the step whose decision was taken; the next batch opens a new quorum.

        With buffers averaged at the batch end (manual optimization, where forward passes may follow the vote), the
        average is taken here, in every group of the quorum whatever its vote, and applied if the step committed. A
        failure after a positive decision stops the group, as any cross-group collective after the decision does.
        """
        if self._decision is None:
            return
        if self.buffers is not None and self.buffers.at_batch_end:
            self.buffers.average()
            failed = self.manager.errored() is not None
            self.buffers.settle(self._decision and not failed)
            self._stop_if_failed_after_commit()
        self.release()


class NonFiniteGradientError(LightningFTError, RuntimeError):
    """The averaged gradient of a step has an inf or NaN: the step is skipped by every replica."""

    def __init__(self, step: int) -> None:
        super().__init__(
            f"lightning-ft: the averaged gradient of step {step} is not finite (inf or NaN); every replica skips it. "
            f"Set FTStrategy(skip_non_finite_steps=False) to step anyway."
        )

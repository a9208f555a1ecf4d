"""The one owner of semi-synchronous steps (LocalSGD, DiLoCo): :class:`SyncOwner`, a machine of :class:`SyncPhase`.

What :class:`~lightning_ft.step.owner.StepOwner` is to a per-step fit, this is to a semi-synchronous one: every sync
(its quorum, its average or outer step, its vote, its close) begins and ends here, and only here. Inner steps are the
group's own (its optimizer, DDP inside the group); the cross-group work is the syncs, every ``sync_period`` inner steps
(:class:`~lightning_ft.algorithms.schedule.SyncSchedule` decides when) and the final ones at the end of training.

The owner's phase says where the group is, and each transition is one method, driven from Lightning's loop by
:class:`~lightning_ft.callbacks.SyncCallback`'s hooks, which hold no state of their own:

==================== ===================================================================================================
phase                what it means, and what leaves it
==================== ===================================================================================================
``NOT_JOINED``       before this process's first batch. :meth:`SyncOwner.begin` joins the job: a sync at the job's
                     start, the sync a restarted group heals into, or a release when every group resumed between syncs.
``INNER_STEPS``      between syncs: no quorum open. :meth:`SyncOwner.begin` opens the next sync at its batch start.
``OVERLAPPED``       a streaming DiLoCo fragment's allreduce is in flight, its quorum open, while the group's own inner
                     steps train (``fragment_sync_delay``); :meth:`SyncOwner.begin` finishes it at the sync step.
``FINAL_SYNCS``      after the last inner step, in :meth:`SyncOwner.end`: each final sync is retried until it commits.
``ENDED_WITH_PEERS`` a group that healed into its peers' final syncs ran them with its peers: it trains no further batch
                     (the batch is skipped as Lightning skips one whose ``on_train_batch_start`` returned -1).
``ENDED``            training ended with every group holding the same parameters.
==================== ===================================================================================================

A sync that does not commit leaves each group with its own parameters, and the next sync brings them together; a
final sync has no next one, so it is retried (:data:`FINAL_SYNC_ATTEMPTS` times in a row at most).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning.pytorch as pl

from lightning_ft import lightning_internals
from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.algorithms.diloco import DiLoCoSync
from lightning_ft.algorithms.local_sgd import average_parameters, take_parameters
from lightning_ft.algorithms.schedule import SyncSchedule
from lightning_ft.errors import LightningFTError
from lightning_ft.heal.state import align_logger_step, align_step_counters, realign_after_the_first_commit
from lightning_ft.settings import FTConfigError
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.protocol import StepProtocol
from lightning_ft_job import events

#: The heal payload's entry for the loop counters and the final syncs left (a joining group takes its peer's).
SYNC_STATE_KEY = "semi_sync"
#: How many times in a row a final sync may fail (a peer died in it, a collective timed out) before the group stops.
FINAL_SYNC_ATTEMPTS = 10

SyncReason = Literal["join", "periodic", "final"]


class FinalSyncError(LightningFTError, RuntimeError):
    """A final sync failed :data:`FINAL_SYNC_ATTEMPTS` times in a row: this group's last inner steps were never
    averaged with its peers', so it stops with an error rather than end as a model of its own."""


class SyncPhase(enum.Enum):
    """Where a semi-synchronous group is (see the module's table)."""

    NOT_JOINED = "not joined"
    INNER_STEPS = "inner steps"
    OVERLAPPED = "overlapped"
    FINAL_SYNCS = "final syncs"
    ENDED_WITH_PEERS = "ended with peers"
    ENDED = "ended"


class SyncOwner:
    """Drives every sync of one semi-synchronous fit through the step protocol, from Lightning's loop.

    Args:
        protocol: The fit's step protocol (the Manager's quorum and vote).
        collectives: The fit's job-wide collectives: a sync section (validation, an epoch end) ends at the next batch.
        algorithm: The fit's algorithm settings (``local_sgd`` or ``diloco``).
        late_group_pending: Whether a late group keeps the job's last step open (a final sync taken again for it is
            not a failure: :func:`lightning_ft.start.last_step.deferred_last_step`).
    """

    def __init__(
        self,
        protocol: StepProtocol,
        collectives: CrossGroupCollectives,
        algorithm: AlgorithmSettings,
        late_group_pending: Callable[[], bool],
    ) -> None:
        self._protocol = protocol
        self._collectives = collectives
        self._algorithm = algorithm
        self._late_group_pending = late_group_pending
        self._schedule = SyncSchedule(period=algorithm.sync_period, delay=algorithm.fragment_sync_delay)
        self.phase = SyncPhase.NOT_JOINED
        self._in_flight: int | None = None  # OVERLAPPED: the DiLoCo fragment whose allreduce is in flight
        self._reason: SyncReason = "join"  # the open sync's
        self._diloco: DiLoCoSync | None = None
        self._restored_diloco: dict[str, Any] | None = None  # from a checkpoint, until the fragments are built
        # FINAL_SYNCS: the final syncs still to run, the open one included (in the heal payload, so that a group
        # joining one of them knows how many follow); 0 otherwise.
        self._final_syncs_left = 0
        self._peers_final_syncs_left = 0  # a healing group's copy of its peer's count, from the heal payload
        self._epoch_progress_at_end: dict[str, Any] | None = None  # ENDED_WITH_PEERS: the loop counters to end with

    @property
    def protocol(self) -> StepProtocol:
        return self._protocol

    @property
    def diloco(self) -> DiLoCoSync | None:
        """With ``algorithm="diloco"``, from ``on_train_start`` on: the fragments and their outer state."""
        return self._diloco

    # ------------------------------------------------------------------ setup
    def register_heal_state(self, trainer: pl.Trainer) -> None:
        """The loop counters and the final syncs left travel in the heal payload: a joining group takes its peer's."""

        def save() -> dict[str, int]:
            return {
                "global_step": trainer.global_step,
                "batches_that_stepped": lightning_internals.batches_that_stepped(trainer),
                "final_syncs_left": self._final_syncs_left,
            }

        def load(state: dict[str, int]) -> None:
            align_step_counters(trainer, int(state["global_step"]))
            align_logger_step(trainer, int(state["batches_that_stepped"]))
            self._peers_final_syncs_left = int(state.get("final_syncs_left", 0))  # absent from older payloads

        self._protocol.manager.register_state_dict_fn(SYNC_STATE_KEY, load, save)

    def restore_diloco(self, state: dict[str, Any] | None) -> None:
        """DiLoCo's state from a checkpoint; Lightning restores it before the fragments exist (kept until then)."""
        self._restored_diloco = state

    def build_diloco(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """DiLoCo's fragments: after a checkpoint restore (their backups start from the restored weights) and before
        the first batch's join sync (they register their heal state with the Manager)."""
        if self._algorithm.algorithm != "diloco":
            return
        if len(trainer.optimizers) != 1:
            raise FTConfigError(
                f"algorithm='diloco' needs exactly one (inner) optimizer, but configure_optimizers() returned "
                f"{len(trainer.optimizers)}. Return a single optimizer."
            )
        self._diloco = DiLoCoSync(self._protocol.manager, module, trainer.optimizers[0], self._algorithm)
        restored, self._restored_diloco = self._restored_diloco, None
        if restored is not None:
            self._diloco.load_state_dict(restored)

    # ------------------------------------------------------------------ the transitions, from Lightning's loop
    def begin(self, trainer: pl.Trainer) -> None:
        """At a training batch's start: join the job at the first, and open or finish the sync the schedule places at
        this one.

        Raises:
            StopIteration: This group healed into its peers' final syncs and ran them (``ENDED_WITH_PEERS``): the
                batch is not trained, as Lightning's loop does for an ``on_train_batch_start`` that returns -1.
        """
        # A sync section (validation, an epoch end) ends with the batch that follows it, as the next step's quorum
        # ends it in per-step training: inner steps in between must not cross groups, or some of their
        # self.log(sync_dist=True) values would be job-wide and others group-local.
        self._collectives.close_section()
        if self.phase is SyncPhase.NOT_JOINED:
            self._join(trainer)
            return
        step, schedule = trainer.global_step, self._schedule
        if self.phase is SyncPhase.OVERLAPPED and schedule.finishes_in_flight(step):
            self._finish(trainer)
            self._end_if_healed_into_final_syncs(trainer, finished=True)
        if self.phase is SyncPhase.INNER_STEPS and schedule.opens(step):
            self._open(trainer, "periodic")
            self._end_if_healed_into_final_syncs(trainer, finished=False)
            if schedule.overlapped:
                self._prepare()
            else:
                self._finish(trainer)
                self._end_if_healed_into_final_syncs(trainer, finished=True)

    def end_epoch(self) -> None:
        """As with per-step training, every group ends an epoch at the same ``global_step``: a sync section."""
        self._collectives.open_section()

    def end(self, trainer: pl.Trainer) -> None:
        """At the end of training: every group ends at the same ``global_step`` with the same parameters.

        A fragment sync still in flight is finished first (its peers have one too). Then, only when the last step is
        a sync step, every fragment syncs in turn (``FINAL_SYNCS``), taking the global parameters
        (``fragment_update_alpha`` is not applied), so that no fragment is left with local values. Otherwise the last
        inner steps stay local (FTStrategy warns at setup).
        """
        if self.phase is SyncPhase.NOT_JOINED:
            return
        if self.phase is SyncPhase.ENDED_WITH_PEERS:
            assert self._epoch_progress_at_end is not None
            trainer.fit_loop.epoch_progress.load_state_dict(self._epoch_progress_at_end)
            return
        if not self._schedule.ends_with_final_syncs(trainer.global_step):
            if self.phase is SyncPhase.OVERLAPPED:
                self._finish(trainer)
            self.phase = SyncPhase.ENDED
            return
        in_flight = self.phase is SyncPhase.OVERLAPPED
        self.phase = SyncPhase.FINAL_SYNCS
        with self._final_sync_rules():
            remaining = 1 if self._diloco is None else self._diloco.num_fragments
            if in_flight:
                self._reason = "final"
                with self._counting_final_syncs(remaining):  # a group that heals into a retry runs them all
                    self._final_sync(trainer, opened=True)
                remaining -= 1
            for left in range(remaining, 0, -1):
                with self._counting_final_syncs(left):
                    self._final_sync(trainer)
        self.phase = SyncPhase.ENDED

    # ------------------------------------------------------------------ one sync: open, (prepare), finish
    def _open(self, trainer: pl.Trainer, reason: SyncReason) -> None:
        """Open the sync's quorum; with synchronous quorum a group that is behind heals in here."""
        self._protocol.open_quorum()
        self._reason = reason
        self._schedule.opened(trainer.global_step)

    def _prepare(self) -> None:
        """Start a DiLoCo fragment's allreduce and let the next inner steps train while it is in flight."""
        assert self._diloco is not None
        self._in_flight = self._diloco.prepare()
        self._protocol.begin_overlapped_sync()
        self.phase = SyncPhase.OVERLAPPED

    def _finish(self, trainer: pl.Trainer) -> bool:
        """Average (or take the outer step), vote, close the quorum; returns whether the sync committed."""
        protocol = self._protocol
        manager = protocol.manager
        protocol.end_overlapped_sync()
        try:
            if self._diloco is None:  # LocalSGD: average, vote, keep the average only on a commit
                params = list(trainer.lightning_module.parameters())
                averaged = average_parameters(manager, params)
                committed = protocol.commit()
                if committed:
                    take_parameters(params, averaged)
            elif self._in_flight is not None:  # DiLoCo: torchft's fragment votes inside its sync
                committed = self._diloco.perform(protocol, self._in_flight)
            elif self._reason == "join" and manager.current_step() == 0:
                self._diloco.barrier_before_the_first_vote()
                committed = protocol.commit()
                self._diloco.reset_global_parameters()
            else:
                committed = self._diloco.sync(protocol)
        finally:
            self._in_flight = None
            if self.phase is SyncPhase.OVERLAPPED:
                self.phase = SyncPhase.INNER_STEPS
            protocol.close()
        self._schedule.finished(trainer.global_step)
        step = manager.current_step()
        protocol.report_step(
            committed, global_step=trainer.global_step, sync=self._reason, opened_at=self._schedule.opened_at
        )
        if realign_after_the_first_commit(trainer, committed, step) and self._diloco is not None:
            self._diloco.reset_global_parameters()  # the backups were taken before the ranks were re-aligned
        return committed

    def _sync(self, trainer: pl.Trainer, reason: SyncReason) -> bool:
        """A whole sync with no overlap; returns whether it committed."""
        self._open(trainer, reason)
        return self._finish(trainer)

    def _final_sync(self, trainer: pl.Trainer, *, opened: bool = False) -> None:
        """One final sync (``opened``: its quorum is open already, the sync in flight or the one this group healed
        in), retried until it commits.

        A periodic sync that fails (a peer died in it) is not retried: the groups train on, and the next sync brings
        them back together. After the last inner step there is no next sync: every group would leave with its own
        parameters. So every group retries, with a new quorum of the groups still alive; the Manager step has not
        moved, so a retry syncs the same fragment. A restarted group may heal into a retry (its peers' count of final
        syncs left is unchanged by a retry)."""
        committed = self._finish(trainer) if opened else self._sync(trainer, "final")
        attempts = 0 if self._late_group_pending() else 1
        while not committed:
            if attempts == FINAL_SYNC_ATTEMPTS:
                raise FinalSyncError(
                    f"lightning-ft: the final sync at global_step {trainer.global_step} failed {attempts} times in a "
                    f"row; this replica group stops instead of ending with parameters its peers do not hold. Its "
                    f"restart joins its peers' final syncs if they still run them, or finds the job finished."
                )
            committed = self._sync(trainer, "final")
            if not self._late_group_pending():  # a sync taken again for a late group is not a failure
                attempts += 1

    def _join(self, trainer: pl.Trainer) -> None:
        """A process lifetime's first batch opens a quorum; where that leaves this group decides what follows.

        * The job's start (Manager step 0): a sync, in which ``init_sync`` makes every group identical.
        * A restarted group heals in the quorum to its peers' ``global_step``, which is the opening step of their
          next sync: it does what they do there, a whole sync, or with ``fragment_sync_delay`` its first half.
        * Every group resumed from the same checkpoint between two syncs (nobody heals: all are at the checkpoint's
          Manager step): no sync here, the quorum is released without a vote, and the schedule goes on as if the job
          had never stopped. Resuming inside a delayed sync's overlap window cannot do that (the pseudo-gradient in
          flight is not in the checkpoint): that sync is redone from the resume point.
        * A restarted group healed into its peers' final syncs: it runs them with its peers and trains no further
          batch (:meth:`_join_final_syncs`).
        """
        self.phase = SyncPhase.INNER_STEPS
        self._open(trainer, "join")
        self._end_if_healed_into_final_syncs(trainer, finished=False)
        step, committed_syncs = trainer.global_step, self._protocol.manager.current_step()
        move = self._schedule.join(step, committed_syncs)
        if move == "finish":
            self._finish(trainer)
        elif move == "release":
            self._protocol.release()
            events.emit("joined_between_syncs", global_step=step, step=committed_syncs)
        else:
            self._prepare()
        self._end_if_healed_into_final_syncs(trainer, finished=True)

    def _end_if_healed_into_final_syncs(self, trainer: pl.Trainer, *, finished: bool) -> None:
        """Where a sync's quorum (synchronous quorum, ``finished=False``) or its vote (asynchronous quorum,
        ``finished=True``) may have healed this group: if the heal came from peers in their final syncs, join them.

        Every sync is such a place, not only a restarted group's join: a group that fell one sync behind while it
        was alive (left out of a quorum it was late for) heals at its next sync, and its peers may be in their final
        syncs by then. It must end with them, not train on alone past ``max_steps``."""
        if self._peers_final_syncs_left:
            self._join_final_syncs(trainer, finished=finished)

    def _join_final_syncs(self, trainer: pl.Trainer, *, finished: bool) -> None:
        """A sync healed this group into its peers' final syncs: they have run their last inner step
        (``global_step`` is now theirs, ``max_steps``) and sync in their ``end``. Finish this sync (unless the heal
        came at its vote, ``finished``) and run the ones left after it with them, as final syncs, then skip the batch
        this group was about to train: another inner step would leave it one step past its peers, with parameters
        they never see.

        Lightning lets only the LightningModule's ``on_train_batch_start`` skip a batch (by returning -1, upon which
        its epoch loop raises ``StopIteration``); this raises the same, from the same place of the loop: nothing of
        the batch runs, neither the step nor the LR schedulers' update. The fit loop then ends the epoch and, with
        ``global_step`` at ``max_steps``, the fit; :meth:`end` restores the epoch counters the peer sent, which had
        already counted this epoch's end.
        """
        left, self._peers_final_syncs_left = self._peers_final_syncs_left, 0
        self.phase = SyncPhase.FINAL_SYNCS
        with self._final_sync_rules():
            if not finished:
                self._final_sync(trainer, opened=True)
            for _ in range(left - 1):
                self._final_sync(trainer)
        self._epoch_progress_at_end = trainer.fit_loop.epoch_progress.state_dict()
        self.phase = SyncPhase.ENDED_WITH_PEERS
        events.emit("joined_final_syncs", global_step=trainer.global_step, syncs=left)
        raise StopIteration

    def _final_sync_rules(self) -> contextlib.AbstractContextManager[None]:
        """DiLoCo's final syncs take the global parameters as they are (``fragment_update_alpha`` is not applied)."""
        return self._diloco.without_update_alpha() if self._diloco is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _counting_final_syncs(self, count: int) -> Iterator[None]:
        """Publish how many final syncs are left (for the heal payload) while this group runs them."""
        self._final_syncs_left = count
        try:
            yield
        finally:
            self._final_syncs_left = 0

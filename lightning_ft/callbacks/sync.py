"""Semi-synchronous training: inner steps inside the group, a cross-group sync every ``sync_every`` inner steps.

Takes the place of :class:`~lightning_ft.callbacks.QuorumCallback` when ``FTStrategy(algorithm="local_sgd")`` or
``"diloco"``. When each sync opens and finishes is decided by :class:`~lightning_ft.algorithms.schedule.SyncSchedule`;
this callback carries the decisions out in Lightning's loop (the quorum, the allreduce, the vote, joining a sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft import lightning_internals as lightning
from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.algorithms.diloco import DiLoCoSync
from lightning_ft.algorithms.local_sgd import local_sgd_sync
from lightning_ft.algorithms.schedule import SyncSchedule
from lightning_ft.callbacks._access import ft_algorithm, ft_collectives, ft_manager, ft_step_protocol
from lightning_ft.errors import LightningFTError, StrategyRequiredError
from lightning_ft.heal.checkpoint_mode import healing
from lightning_ft.heal.state import align_logger_step, align_step_counters, broadcast_state_in_group
from lightning_ft.settings import FTConfigError
from lightning_ft.start.last_step import deferred_last_step
from lightning_ft_job import events

SYNC_STATE_KEY = "semi_sync"
DILOCO_CHECKPOINT_KEY = "lightning_ft_diloco"
#: How many times in a row a final sync may fail (a peer died in it, a collective timed out) before the group stops.
FINAL_SYNC_ATTEMPTS = 10


class FinalSyncError(LightningFTError, RuntimeError):
    """A final sync failed :data:`FINAL_SYNC_ATTEMPTS` times in a row: this group's last inner steps were never
    averaged with its peers', so it stops with an error rather than end as a model of its own."""


def _algorithm(trainer: pl.Trainer) -> AlgorithmSettings:
    algorithm = ft_algorithm(trainer)
    if algorithm is None or not algorithm.semi_sync:
        raise StrategyRequiredError("SyncCallback needs FTStrategy(algorithm='local_sgd') or 'diloco'.")
    return algorithm


class SyncCallback(Callback):
    """Syncs at the start of the batch that follows every ``sync_period``-th inner step (``sync_every``, or
    ``sync_every / fragments`` for streaming DiLoCo, one fragment per sync), and once more at the end of training.

    Why at a batch start, not right after the inner step: a group that restarts joins with a sync at the start of its
    first batch (the lighthouse holds its quorum request until its peers open their next sync), so when every sync
    sits at a batch start, the joining group and its peers make the same collectives at the same place of the loop:
    the heal payload's loop position (taken by :class:`~lightning_ft.callbacks.DataPositionCallback` just before
    the quorum) is exactly the batch the joining group is about to train, and the epoch rollover is Lightning's.

    With streaming DiLoCo's ``fragment_sync_delay`` (τ) a sync comes in two halves: at the batch start τ inner steps
    before the sync step, the quorum opens and the fragment's pseudo-gradient allreduce starts; τ inner steps later,
    at the sync step's batch start, the allreduce is waited on, the outer step taken and the vote held. The quorum
    stays open in between, but those inner steps are the group's own work (``StepProtocol.sync_in_flight``): their
    collectives stay inside the group, as in every other inner step.

    ``trainer.global_step`` counts inner steps and is Lightning's own; a healing group takes its peer's value from the
    heal payload. The Manager step counts committed syncs (the join sync at the start of the job included).

    A group that restarts while its peers are in their final syncs (``on_train_end``, after their last inner step)
    joins those: the heal payload says how many of them are left, the group runs them with its peers, and it trains no
    further batch (see :meth:`_join_final_syncs`).
    """

    def __init__(self) -> None:
        self._joined = False
        self._schedule = SyncSchedule(period=1)  # the fit's, from setup on: when each sync opens and finishes
        self._in_flight: int | None = None  # the DiLoCo fragment whose allreduce overlaps the inner steps
        self._reason = ""
        self._diloco: DiLoCoSync | None = None
        self._restored_diloco: dict[str, Any] | None = None
        # This group's final syncs still to run, the one being opened included: in the heal payload, so that a group
        # joining one of them knows how many follow. 0 outside on_train_end.
        self._final_syncs_left = 0
        # A healing group's copy of its peer's count, taken from the heal payload.
        self._peers_final_syncs_left = 0
        # Set when this group joined its peers' final syncs: its loop counters to end with (see on_train_end).
        self._joined_final_epoch_progress: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        algorithm = _algorithm(trainer)
        self._joined = False
        self._schedule = SyncSchedule(period=algorithm.sync_period, delay=algorithm.fragment_sync_delay)
        self._in_flight = None
        self._reason = ""
        self._diloco = None
        self._restored_diloco = None  # Lightning restores a checkpoint after setup (see on_load_checkpoint)
        self._final_syncs_left = self._peers_final_syncs_left = 0
        self._joined_final_epoch_progress = None

        def save() -> dict[str, int]:
            return {
                "global_step": trainer.global_step,
                "batches_that_stepped": lightning.batches_that_stepped(trainer),
                "final_syncs_left": self._final_syncs_left,
            }

        def load(state: dict[str, int]) -> None:
            align_step_counters(trainer, int(state["global_step"]))
            align_logger_step(trainer, int(state["batches_that_stepped"]))
            self._peers_final_syncs_left = int(state.get("final_syncs_left", 0))  # absent from older payloads

        ft_manager(trainer).register_state_dict_fn(SYNC_STATE_KEY, load, save)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """DiLoCo's fragments are built here: after a checkpoint restore (their backups start from the restored
        weights) and before the first batch's join sync (they register their heal state with the Manager)."""
        if _algorithm(trainer).algorithm != "diloco":
            return
        if len(trainer.optimizers) != 1:
            raise FTConfigError(
                f"algorithm='diloco' needs exactly one (inner) optimizer, but configure_optimizers() returned "
                f"{len(trainer.optimizers)}. Return a single optimizer."
            )
        self._diloco = DiLoCoSync(ft_manager(trainer), pl_module, trainer.optimizers[0], _algorithm(trainer))
        restored, self._restored_diloco = self._restored_diloco, None
        if restored is not None:
            self._diloco.load_state_dict(restored)

    @property
    def outer_state(self) -> dict[str, Any] | None:
        """With ``algorithm="diloco"`` while fitting: each fragment's global parameters and outer optimizer state
        (what a checkpoint holds beside the model, and what a heal carries); ``None`` otherwise."""
        return self._diloco.state_dict() if self._diloco is not None else None

    # DiLoCo's global parameters and outer optimizer state go into checkpoint files through the checkpoint hooks,
    # not into a heal: torchft's own fragment entries carry them there.
    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._diloco is not None and not healing(trainer):
            checkpoint[DILOCO_CHECKPOINT_KEY] = self._diloco.state_dict()

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Runs before ``on_train_start`` builds the fragments: keep the state until then."""
        if not healing(trainer):
            self._restored_diloco = checkpoint.get(DILOCO_CHECKPOINT_KEY)

    # ------------------------------------------------------------------ one sync: open, (prepare), finish
    def _open(self, trainer: pl.Trainer, reason: str) -> None:
        """Open the sync's quorum; with synchronous quorum a group that is behind heals in here."""
        ft_step_protocol(trainer).open_quorum()
        self._reason = reason
        self._schedule.opened(trainer.global_step)

    def _prepare(self, trainer: pl.Trainer) -> None:
        """Start a DiLoCo fragment's allreduce and let the next inner steps train while it is in flight."""
        assert self._diloco is not None
        self._in_flight = self._diloco.prepare()
        ft_step_protocol(trainer).begin_overlapped_sync()

    def _finish(self, trainer: pl.Trainer) -> bool:
        """Average (or take the outer step), vote, close the quorum; returns whether the sync committed."""
        protocol = ft_step_protocol(trainer)
        manager = protocol.manager
        protocol.end_overlapped_sync()
        try:
            if self._diloco is None:
                committed = local_sgd_sync(protocol, list(trainer.lightning_module.parameters()))
            elif self._in_flight is not None:
                committed = self._diloco.perform(protocol, self._in_flight)
            elif self._reason == "join" and manager.current_step() == 0:
                committed = self._diloco.join_at_start(protocol)
            else:
                committed = self._diloco.sync(protocol)
        finally:
            self._in_flight = None
            protocol.close()
        self._schedule.finished(trainer.global_step)
        if events.enabled():
            events.emit(
                "step",
                step=manager.current_step(),
                global_step=trainer.global_step,
                committed=committed,
                participants=manager.num_participants(),
                sync=self._reason,
                opened_at=self._schedule.opened_at,
            )
        if committed and manager.current_step() == 1 and trainer.world_size > 1:
            # init_sync healed each group rank from a possibly different group (see broadcast_state_in_group).
            broadcast_state_in_group(trainer)
            if self._diloco is not None:
                self._diloco.reset_global_parameters()  # the backups were taken before the ranks were re-aligned
        return committed

    def _sync(self, trainer: pl.Trainer, reason: str) -> bool:
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
        attempts = 0 if deferred_last_step(ft_manager(trainer)) else 1
        while not committed:
            if attempts == FINAL_SYNC_ATTEMPTS:
                raise FinalSyncError(
                    f"lightning-ft: the final sync at global_step {trainer.global_step} failed {attempts} times in a "
                    f"row; this replica group stops instead of ending with parameters its peers do not hold. Its "
                    f"restart joins its peers' final syncs if they still run them, or finds the job finished."
                )
            committed = self._sync(trainer, "final")
            if not deferred_last_step(ft_manager(trainer)):  # a sync taken again for a late group is not a failure
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
        self._open(trainer, "join")
        self._end_if_healed_into_final_syncs(trainer, finished=False)
        step, committed_syncs = trainer.global_step, ft_manager(trainer).current_step()
        move = self._schedule.join(step, committed_syncs)
        if move == "finish":
            self._finish(trainer)
        elif move == "release":
            ft_step_protocol(trainer).release()
            events.emit("joined_between_syncs", global_step=step, step=committed_syncs)
        else:
            self._prepare(trainer)
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
        (``global_step`` is now theirs, ``max_steps``) and sync in ``on_train_end``. Finish this sync (unless the heal
        came at its vote, ``finished``) and run the ones left after it with them, as final syncs, then skip the batch
        this group was about to train: another inner step would leave it one step past its peers, with parameters
        they never see.

        Lightning lets only the LightningModule's ``on_train_batch_start`` skip a batch (by returning -1), so this
        raises ``StopIteration``, which Lightning's epoch loop takes as the end of the epoch, as it does for -1:
        nothing of the batch runs, neither the step nor the LR schedulers' update. The fit loop then ends the epoch
        and, with ``global_step`` at ``max_steps``, the fit; :meth:`on_train_end` restores the epoch counters the
        peer sent, which had already counted this epoch's end.
        """
        left, self._peers_final_syncs_left = self._peers_final_syncs_left, 0
        with self._final_sync_rules():
            if not finished:
                self._final_sync(trainer, opened=True)
            for _ in range(left - 1):
                self._final_sync(trainer)
        self._joined_final_epoch_progress = trainer.fit_loop.epoch_progress.state_dict()
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

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A sync section (validation, an epoch end) ends with the batch that follows it, as the next step's quorum
        # ends it in per-step training: inner steps in between must not cross groups, or some of their
        # self.log(sync_dist=True) values would be job-wide and others group-local.
        ft_collectives(trainer).close_section()
        if not self._joined:
            self._joined = True
            self._join(trainer)
            return
        step, schedule = trainer.global_step, self._schedule
        if self._in_flight is not None and schedule.finishes_in_flight(step):
            self._finish(trainer)
            self._end_if_healed_into_final_syncs(trainer, finished=True)
        if self._in_flight is None and schedule.opens(step):
            self._open(trainer, "periodic")
            self._end_if_healed_into_final_syncs(trainer, finished=False)
            if schedule.overlapped:
                self._prepare(trainer)
            else:
                self._finish(trainer)
                self._end_if_healed_into_final_syncs(trainer, finished=True)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """As with per-step training, every group ends an epoch at the same ``global_step``."""
        ft_collectives(trainer).open_section()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The final sync: every group ends training at the same ``global_step`` and leaves with the same parameters.

        A fragment sync still in flight is finished first (its peers have one too). Then, only when the last step is
        a sync step, every fragment syncs in turn, taking the global parameters (``fragment_update_alpha`` is not
        applied), so that no fragment is left with local values. Otherwise the last inner steps stay local (FTStrategy
        warns at setup).
        """
        if not self._joined:
            return
        if self._joined_final_epoch_progress is not None:
            trainer.fit_loop.epoch_progress.load_state_dict(self._joined_final_epoch_progress)
            return
        if not self._schedule.ends_with_final_syncs(trainer.global_step):
            if self._in_flight is not None:
                self._finish(trainer)
            return
        with self._final_sync_rules():
            remaining = 1 if self._diloco is None else self._diloco.num_fragments
            if self._in_flight is not None:
                self._reason = "final"
                with self._counting_final_syncs(remaining):  # a group that heals into a retry runs them all
                    self._final_sync(trainer, opened=True)
                remaining -= 1
            for left in range(remaining, 0, -1):
                with self._counting_final_syncs(left):
                    self._final_sync(trainer)

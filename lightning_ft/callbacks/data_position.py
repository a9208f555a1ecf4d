"""Keep every replica group at the same loop position, each in its own shard: after a heal and after a resume."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft import lightning_internals
from lightning_ft.callbacks._access import ft_data_mode, ft_manager, ft_step_protocol
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.data.position import (
    LoopPosition,
    ResumePlan,
    align_with_peer,
    reposition_fetcher,
    resume_fetcher,
    supports_repositioning,
)
from lightning_ft.heal.checkpoint_mode import healing
from lightning_ft.loop_patches import LoopPatches
from lightning_ft.settings import FTConfigError
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

DATA_POSITION_KEY = "data_position"


@dataclass(frozen=True)
class _PendingReposition:
    iterator_epoch: int  # the epoch this group's iterator reads
    target_epoch: int  # the peer's


class DataPositionCallback(FTCallback):
    """Moves this group's data iterator to where its peers are, in its own shard.

    **Heal.** The Manager's heal payload carries the loop position the peer had when its current optimizer step
    began (taken here, before the step's quorum opens, so that it is the same whether the peer is read during its
    synchronous quorum or halfway through the step with asynchronous quorum). The healing group shifts its batch
    counters by the difference between that position and its own at the start of the same step, and at the end of
    the batch that healed, moves its iterator to the peer's next batch index, in the peer's epoch. The batch that was
    already loaded when the heal came is not given back: with synchronous quorum it is trained on (it is this
    group's contribution to the healing step), with asynchronous quorum the healing group sits the step out.

    **Resume.** A checkpoint restores the counters; the iterator is recreated and moved to them before the first
    batch (see :func:`~lightning_ft.data.position.resume_fetcher`), from this rank's own ``StatefulDataLoader``
    state when the strategy found one beside the checkpoint, else by counting.

    The step's starting position is taken by an observer of the step protocol
    (:meth:`~lightning_ft.step.protocol.StepProtocol.on_step_start`), just before whichever code opens the step's
    quorum, so this callback may sit anywhere in ``Trainer(callbacks=[...])``.
    """

    def __init__(self) -> None:
        self._step_start: LoopPosition | None = None
        self._pending: _PendingReposition | None = None
        self._resume: ResumePlan | None = None
        self._patches = LoopPatches()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: observe each step's start, add the loop position to the Manager's heal payload, and hook the
        epoch loop's start (where a resume moves the iterator).

        Raises:
            StrategyRequiredError: The strategy has no torchft Manager or step protocol (not FTStrategy).
            FTConfigError: The fit's ``data_mode`` is ``"exactly_once"``, whose data callback takes this one's place.
        """
        if stage != "fit":
            return
        if ft_data_mode(trainer) == "exactly_once":
            raise FTConfigError(
                "DataPositionCallback keeps the position of sharded data; with FTStrategy(data_mode='exactly_once') "
                "ExactlyOnceDataCallback does its job (FTStrategy adds it). Remove DataPositionCallback."
            )
        self._step_start = self._pending = self._resume = None
        ft_step_protocol(trainer).on_step_start(lambda: self._record_step_start(trainer))
        ft_manager(trainer).register_state_dict_fn(
            DATA_POSITION_KEY,
            lambda state: self._load_peer_position(trainer, state),
            lambda: self._step_start_position(trainer).as_dict(),
        )
        self._wrap_epoch_start(trainer)

    def _wrap_epoch_start(self, trainer: pl.Trainer) -> None:
        """Run :meth:`_after_epoch_start` right after the epoch loop's ``on_run_start``: the one point between
        Lightning's own restore of the position and the first batch of the epoch (no callback hook sits there)."""

        def make(
            run_start: Callable[[lightning_internals.DataFetcher], None],
        ) -> Callable[[lightning_internals.DataFetcher], None]:
            def on_run_start(data_fetcher: lightning_internals.DataFetcher) -> None:
                run_start(data_fetcher)
                self._after_epoch_start(trainer, data_fetcher)

            return on_run_start

        self._patches.undo()
        self._patches.wrap(trainer.fit_loop.epoch_loop, "on_run_start", make)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo the epoch loop's hook."""
        self._patches.undo()

    # ------------------------------------------------------------------ resume
    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A resume's plan. Not a heal's: a heal moves this group to its peer's position in its own shard, under its
        own key (the peer's checkpoint tells where the peer is in *its* shard)."""
        if not healing(trainer):
            self._resume = ResumePlan.from_checkpoint(checkpoint)

    def _after_epoch_start(self, trainer: pl.Trainer, fetcher: lightning_internals.DataFetcher) -> None:
        plan, self._resume = self._resume, None
        if plan is None:
            return
        if not supports_repositioning(fetcher):
            log.warning("lightning-ft: training_step reads the dataloader itself; its position is not restored")
            return
        position = resume_fetcher(trainer, fetcher, plan)
        log.info(
            "lightning-ft: resuming this group's shard at epoch %d, batch %d (%s)",
            trainer.current_epoch,
            position,
            "from its own loader state" if plan.loader_states else "by counting batches",
        )
        events.emit(
            "data_position_restored",
            source=plan.source,
            epoch=trainer.current_epoch,
            batch=position,
            step=trainer.global_step,
        )

    # ------------------------------------------------------------------ heal
    def _record_step_start(self, trainer: pl.Trainer) -> None:
        """Called as a step's (or sync's) quorum is about to open: where this group's current optimizer step began."""
        self._step_start = LoopPosition.of(trainer)

    def _step_start_position(self, trainer: pl.Trainer) -> LoopPosition:
        """This group's position when its current optimizer step began. Read on a live peer's quorum thread too.

        Falls back to the live counters if a quorum was opened without a batch start before it (a custom loop).
        """
        return self._step_start or LoopPosition.of(trainer)

    def _load_peer_position(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        """Runs on the training thread of the healing group, inside the quorum or the commit vote."""
        peer = LoopPosition.from_dict(state)
        own = self._step_start_position(trainer)
        align_with_peer(trainer.fit_loop.epoch_loop.batch_progress, own, peer)
        self._step_start = peer
        if peer != own:
            self._pending = _PendingReposition(iterator_epoch=own.epoch, target_epoch=peer.epoch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the batch that healed: move this group's iterator to its peer's next batch index, in its own shard
        (a ``training_step`` that reads the dataloader itself is left where it is, with a warning)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        fetcher = lightning_internals.data_fetcher(trainer)
        combined_loader = lightning_internals.combined_loader(trainer)
        assert fetcher is not None and combined_loader is not None
        if not supports_repositioning(fetcher):
            log.warning("lightning-ft: training_step reads the dataloader itself; its position is not aligned")
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        target = progress.current.ready
        if fetcher.length is not None and target >= fetcher.length:
            how = "epoch_end"  # the peer's epoch ends with this batch; the next epoch starts a new iterator anyway
            progress.is_last_batch = True
        else:
            how = reposition_fetcher(
                fetcher,
                combined_loader.flattened,
                iterator_epoch=pending.iterator_epoch,
                target_epoch=pending.target_epoch,
                target_position=target,
            )
            progress.is_last_batch = fetcher.done
        log.info(
            "lightning-ft: this group continues its shard at its peer's position: epoch %d, batch %d",
            pending.target_epoch,
            target,
        )
        events.emit("data_repositioned", how=how, epoch=pending.target_epoch, batch=target, step=trainer.global_step)

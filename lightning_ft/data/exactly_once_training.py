"""``data_mode="exactly_once"`` inside the strategy: the training loader is rebuilt to read what the committed state
assigns, and each training batch is checked against the step's quorum (:mod:`.placement` holds the schedule).

Only the training dataloader changes: Lightning builds every loader through ``Strategy.process_dataloader``, so the
fit loop's ``setup_data`` is marked while it runs, and only a loader built then is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_ft import lightning_internals
from lightning_ft.data.placement import ExactlyOnceData, StepPlacement, exactly_once_loader
from lightning_ft.loop_patches import LoopPatches
from lightning_ft.manager import FTManager
from lightning_ft.settings import FTConfigError, FTSettings
from lightning_ft_job import events


class ExactlyOnceTraining:
    """The exactly-once training loader of one fit, and the per-batch check against the step's quorum."""

    def __init__(self) -> None:
        self.data: ExactlyOnceData | None = None
        self._building_train_loader = False

    def prepare(self, trainer: pl.Trainer, patches: LoopPatches) -> None:
        """Mark the training dataloader's setup, so that :meth:`process_dataloader` rebuilds that loader only."""
        if trainer.accumulate_grad_batches != 1:
            raise FTConfigError(
                f"data_mode='exactly_once' with accumulate_grad_batches={trainer.accumulate_grad_batches}: a step's "
                "samples are known only once its quorum has formed, at its first micro-batch. Use "
                "accumulate_grad_batches=1 with a larger batch_size, or data_mode='sharded'."
            )

        def make(setup_data: Callable[[], None]) -> Callable[[], None]:
            def setup_train_data() -> None:
                self._building_train_loader = True
                try:
                    setup_data()
                finally:
                    self._building_train_loader = False

            return setup_train_data

        patches.wrap(trainer.fit_loop, "setup_data", make)

    @property
    def building_train_loader(self) -> bool:
        return self._building_train_loader

    def train_loader(
        self, dataloader: object, settings: FTSettings, group_size: int, group_rank: int, manager: FTManager
    ) -> object:
        """The training loader that reads the samples the committed state assigns. Until the first quorum, it guesses
        that every group takes part (with spares, the first ``min_replica_size``)."""
        spares = settings.world_size_mode == "fixed_with_spares"
        participants = settings.min_replica_size if spares else settings.num_replica_groups
        own_rank = settings.replica_group_id if settings.replica_group_id < participants else None
        loader, self.data = exactly_once_loader(
            dataloader,
            group_size=group_size,
            group_rank=group_rank,
            participants_guess=participants,
            rank_guess=own_rank,
            committed=manager.batches_committed,
        )
        return loader

    def batch_for_step(self, batch: Any, trainer: pl.Trainer, manager: FTManager, dataloader_idx: int) -> Any:
        """Check a training batch against the samples the step's quorum assigns (opened before, by the step owner:
        a behind group healed there), and refetch it if the loader's prediction was wrong."""
        assert self.data is not None
        placement = StepPlacement(
            cursor=manager.batches_committed(),
            participants=manager.num_participants(),
            participating_rank=manager.participating_rank(),
        )
        batch, refetched = self.data.batch_for_step(batch, placement)
        if refetched:
            batch = trainer.precision_plugin.convert_input(batch)
            batch = lightning_internals.run_on_before_batch_transfer(trainer.lightning_module, batch, dataloader_idx)
            events.emit("data_refetched", step=manager.current_step(), cursor=placement.cursor)
        return batch

"""Semi-synchronous training: inner steps inside the group, a cross-group sync every ``sync_every`` inner steps.

Takes the place of :class:`~lightning_ft.callbacks.QuorumCallback` when ``FTStrategy(algorithm="local_sgd")`` or
``"diloco"``. The syncs are owned by the fit's :class:`~lightning_ft.algorithms.sync_owner.SyncOwner` (its phases and
transitions); this callback is where Lightning's loop reaches the owner, and keeps no state of its own.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft.algorithms.sync_owner import FINAL_SYNC_ATTEMPTS, SYNC_STATE_KEY, FinalSyncError, SyncOwner
from lightning_ft.callbacks._access import ft_sync_owner
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.heal.checkpoint_mode import healing

#: DiLoCo's global parameters and outer optimizer state in a checkpoint file.
DILOCO_CHECKPOINT_KEY = "lightning_ft_diloco"

__all__ = ["DILOCO_CHECKPOINT_KEY", "FINAL_SYNC_ATTEMPTS", "SYNC_STATE_KEY", "FinalSyncError", "SyncCallback"]


class SyncCallback(FTCallback):
    """Syncs at the start of the batch that follows every ``sync_period``-th inner step (``sync_every``, or
    ``sync_every / fragments`` for streaming DiLoCo, one fragment per sync), and once more at the end of training.

    Why at a batch start, not right after the inner step: a group that restarts joins with a sync at the start of its
    first batch (the lighthouse holds its quorum request until its peers open their next sync), so when every sync
    sits at a batch start, the joining group and its peers make the same collectives at the same place of the loop:
    the heal payload's loop position (taken by :class:`~lightning_ft.callbacks.DataPositionCallback` just before
    the quorum) is exactly the batch the joining group is about to train, and the epoch rollover is Lightning's.

    ``trainer.global_step`` counts inner steps and is Lightning's own; a healing group takes its peer's value from the
    heal payload. The Manager step counts committed syncs (the join sync at the start of the job included).
    """

    def __init__(self) -> None:
        self._owner: SyncOwner | None = None

    @property
    def outer_state(self) -> dict[str, Any] | None:
        """With ``algorithm="diloco"`` while fitting: each fragment's global parameters and outer optimizer state
        (what a checkpoint holds beside the model, and what a heal carries); ``None`` otherwise."""
        diloco = self._owner.diloco if self._owner is not None else None
        return diloco.state_dict() if diloco is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._owner = ft_sync_owner(trainer)
            self._owner.register_heal_state(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """DiLoCo's fragments are built here: after a checkpoint restore, before the first batch's join sync."""
        ft_sync_owner(trainer).build_diloco(trainer, pl_module)

    # DiLoCo's global parameters and outer optimizer state go into checkpoint files through the checkpoint hooks,
    # not into a heal: torchft's own fragment entries carry them there.
    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.outer_state is not None and not healing(trainer):
            checkpoint[DILOCO_CHECKPOINT_KEY] = self.outer_state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Runs before ``on_train_start`` builds the fragments: the owner keeps the state until then."""
        if not healing(trainer):
            ft_sync_owner(trainer).restore_diloco(checkpoint.get(DILOCO_CHECKPOINT_KEY))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        ft_sync_owner(trainer).begin(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ft_sync_owner(trainer).end_epoch()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ft_sync_owner(trainer).end(trainer)

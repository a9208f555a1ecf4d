"""The Manager's committed-step state inside Lightning checkpoints."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft.callbacks._access import ft_manager, has_ft_manager
from lightning_ft.callbacks._batch_hooks import FTCallback


class ManagerCheckpointCallback(FTCallback):
    """Saves ``Manager.state_dict()`` (``step``, ``batches_committed``) with every checkpoint and restores it.

    torchft's Manager documents this as required: a job resumed from a checkpoint without it would restart the
    committed-step count at 0 while the weights are from step N, and healing would pick the wrong source.
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remember the trainer, whose Manager :meth:`state_dict` and :meth:`load_state_dict` read."""
        # Lightning restores callback state after `setup`, so the trainer (and its Manager) is known by then.
        self._trainer = trainer

    @override
    def state_dict(self) -> dict[str, Any]:
        """The Manager's state, for the checkpoint.

        Returns:
            The Manager's ``state_dict()`` under the key ``"manager"``, or an empty dict when no Manager runs (not
            FTStrategy, or after the fit).
        """
        if self._trainer is None or not has_ft_manager(self._trainer):
            return {}
        return {"manager": dict(ft_manager(self._trainer).state_dict())}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint without the Manager's state (one Lightning wrote without FTStrategy, or ``save_checkpoint``
        after the fit, when the Manager is gone): its ``global_step`` is the committed step, and the count of committed
        batches is taken as one participant per step."""
        if self.state_key in checkpoint.get("callbacks", {}) or not has_ft_manager(trainer):
            return
        step = int(checkpoint.get("global_step", 0))
        ft_manager(trainer).load_state_dict({"step": step, "batches_committed": step})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the Manager's committed step count from what :meth:`state_dict` saved (nothing without a
        Manager)."""
        if "manager" in state_dict and self._trainer is not None and has_ft_manager(self._trainer):
            ft_manager(self._trainer).load_state_dict(state_dict["manager"])

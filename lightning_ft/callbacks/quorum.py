"""Open each optimizer step's quorum before the other callbacks' batch start, and epoch ends' sync sections."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft.callbacks._access import ft_collectives, ft_step_owner
from lightning_ft.callbacks._batch_hooks import FTCallback


class QuorumCallback(FTCallback):
    """The Lightning side of the step owner (:class:`lightning_ft.step.owner.StepOwner`) at batch start and epoch end.

    **Batch start.** Asks the step owner to begin the step: its quorum opens once per accumulation window, before the
    forward pass (an asynchronous quorum then overlaps it; a synchronous one heals a behind group before it computes
    anything), and ``trainer.global_step`` is put on the Manager's committed step count, so ``max_steps``, checkpoint
    names and loggers count committed steps only. FTStrategy puts this callback before the others, so that their
    batch-start hooks see the step's quorum; without it, the strategy's own batch-start hook opens the quorum after
    them. The step itself (vote, commit, close, counters) is the owner's, whatever the order of the callbacks.

    **Epoch end.** Opens a sync section for cross-group reductions (:mod:`lightning_ft.step.collectives`): every
    group ends the epoch at the same committed step, so epoch-level metrics and the decisions of ``EarlyStopping`` and
    ``ModelCheckpoint`` that follow may reduce across groups.
    """

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Begin the optimizer step: its quorum opens (once per accumulation window) and ``trainer.global_step`` is
        put on the committed step count.

        Raises:
            StrategyRequiredError: The strategy has no step owner (not FTStrategy, or a semi-synchronous
                ``algorithm``, which uses ``SyncCallback`` instead).
        """
        ft_step_owner(trainer).begin(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open a sync section, so that the epoch end's reductions may cross groups.

        Raises:
            StrategyRequiredError: The strategy has no cross-group collectives (not FTStrategy).
        """
        ft_collectives(trainer).open_section()

"""Open the quorum at optimizer-step boundaries; keep Lightning's counters on committed steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft.callbacks._access import ft_collectives, ft_step_protocol
from lightning_ft.callbacks.monitor import loss_of
from lightning_ft.hsdp.shards import holds_shards
from lightning_ft.state import align_logger_step, align_step_counters, broadcast_state_in_group
from lightning_ft_job import events


class QuorumCallback(Callback):
    """Starts each optimizer step's torchft quorum before the forward pass, once per accumulation window.

    Starting it at batch start lets an asynchronous quorum overlap the forward pass, and lets a synchronous one heal a
    behind replica before it computes anything. At batch end, ``trainer.global_step`` is set to the Manager's
    committed step count, so ``max_steps``, checkpoint names and loggers count committed steps only. At an epoch end
    it opens a sync section for cross-group reductions (:mod:`lightning_ft.step.collectives`). After the job's first
    committed step, groups of several processes re-align their ranks (see
    :func:`~lightning_ft.state.broadcast_state_in_group`).
    """

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        protocol = ft_step_protocol(trainer)
        protocol.open_quorum()
        committed = protocol.manager.current_step()
        align_step_counters(trainer, committed)
        align_logger_step(trainer, committed)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        protocol = ft_step_protocol(trainer)
        committed = protocol.manager.current_step()
        if protocol.decided:
            if events.enabled():
                error = protocol.manager.errored()
                events.emit(
                    "step",
                    step=committed,
                    committed=protocol.last_step_committed,
                    participants=protocol.manager.num_participants(),
                    loss=protocol.step_loss if protocol.step_loss is not None else loss_of(outputs),
                    **({"error": repr(error.original_exception)} if error is not None else {}),
                )
            if protocol.last_step_committed and committed == 1 and trainer.world_size > 1 and not holds_shards(trainer):
                # (With FSDP each rank holds a different shard; rank r of every group healed from the same group.)
                broadcast_state_in_group(trainer)
        protocol.close()
        align_step_counters(trainer, committed)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every group ends the epoch at the same committed step: epoch-level metrics and the decisions of
        ``EarlyStopping``/``ModelCheckpoint`` that follow may reduce across groups."""
        ft_collectives(trainer).open_section()

"""With exactly-once data: end epochs where the committed data does, and give a healed group its peer's counters."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft.callbacks._access import ft_data_mode, ft_exactly_once_data, ft_manager, ft_step_protocol
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.callbacks.data_position import DATA_POSITION_KEY
from lightning_ft.data.placement import ExactlyOnceData
from lightning_ft.data.position import LoopPosition, align_with_peer
from lightning_ft.settings import FTConfigError
from lightning_ft_job import events


class ExactlyOnceDataCallback(FTCallback):
    """The loop side of ``FTStrategy(data_mode="exactly_once")`` (see :mod:`lightning_ft.data.placement`); it takes
    :class:`~lightning_ft.callbacks.DataPositionCallback`'s place in that mode.

    **Epoch ends.** The training loader never runs out: an epoch ends after the committed step that consumed the last
    group batch of the epoch's permutation. That is decided from the committed state, which every group shares, so
    every group ends the epoch (and validates, and steps epoch schedulers) at the same step.

    **Heal.** Which samples a group reads follows from torchft's ``batches_committed``, which the heal already
    carries; what is left is Lightning's batch counters (validation every N batches counts them), which are shifted
    to the peer's. Both sides read their counters at the same point, inside the step's synchronous quorum.
    """

    def __init__(self) -> None:
        self._data: ExactlyOnceData | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: add Lightning's batch counters to the Manager's heal payload.

        Raises:
            StrategyRequiredError: The strategy has no torchft Manager (not FTStrategy).
            FTConfigError: The fit's ``data_mode`` is not ``"exactly_once"`` (sharded data has DataPositionCallback).
        """
        if stage != "fit":
            return
        if ft_data_mode(trainer) != "exactly_once":
            raise FTConfigError(
                "ExactlyOnceDataCallback works with FTStrategy(data_mode='exactly_once'); this fit's data is sharded, "
                "whose position DataPositionCallback keeps (FTStrategy adds it). Set data_mode='exactly_once' or "
                "remove ExactlyOnceDataCallback."
            )
        ft_manager(trainer).register_state_dict_fn(
            DATA_POSITION_KEY,
            lambda state: self._load_peer_position(trainer, state),
            lambda: LoopPosition.of(trainer).as_dict(),
        )

    def _load_peer_position(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        align_with_peer(
            trainer.fit_loop.epoch_loop.batch_progress, LoopPosition.of(trainer), LoopPosition.from_dict(state)
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        data = ft_exactly_once_data(trainer)
        if data is None or data.last_placement is None:
            return
        if ft_step_protocol(trainer).last_step_committed and data.schedule.ends_epoch(data.last_placement):
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
            events.emit(
                "data_epoch_end",
                data_epoch=data.schedule.epoch_of(data.last_placement.cursor),
                step=trainer.global_step,
            )

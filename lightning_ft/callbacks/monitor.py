"""The ``ft/`` metrics for the Trainer's loggers, ``replicas P/N`` in the progress bar, exceptions in the event log,
and the loggers' pointer to the run's event log."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_ft import lightning_internals
from lightning_ft.callbacks._access import (
    ft_exactly_once_data,
    ft_manager,
    ft_step_protocol,
    ft_telemetry,
    has_ft_manager,
    is_semi_sync,
)
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.loop_patches import LoopPatches
from lightning_ft_job import events

PREFIX = "ft/"


class FaultToleranceMonitor(FTCallback):
    """Reports what fault tolerance did, the way Lightning's ``LearningRateMonitor`` reports learning rates.

    **Metrics.** At the end of a training batch, whenever Lightning logs its own step metrics (every
    ``log_every_n_steps``), each of ``trainer.loggers`` gets the ``ft/`` metrics through ``logger.log_metrics`` at the
    step Lightning logs that batch's metrics at (the step owner keeps it on committed steps), so they line up
    with the loss. A batch in which this group healed is always logged, so every heal's duration reaches the loggers.
    Why the loggers directly and not ``LightningModule.log``: the values are plain Python numbers that need no
    device tensor, no reduction and no place in ``callback_metrics``; ``self.log`` would turn each into a tensor on
    the device every batch. Nothing here is reduced or exchanged across groups (no ``sync_dist``): every figure is
    this group's own (:mod:`lightning_ft.manager.telemetry`), and Lightning's rank-zero rule, which FTStrategy makes
    job-wide, lets group 0's rank 0 write them. With no logger or ``log_every_n_steps=0`` nothing is logged.

    | Metric                             | Meaning                                                              |
    | ---------------------------------- | -------------------------------------------------------------------- |
    | ``ft/participants``                | replica groups in the latest quorum                                  |
    | ``ft/quorum_id``                   | the lighthouse's id of that quorum (it changes when membership does) |
    | ``ft/committed_steps``             | the Manager's committed step count (the same in every group)         |
    | ``ft/uncommitted_steps``           | votes of this group that did not commit, in this process             |
    | ``ft/non_finite_skips``            | of those, steps every replica skipped for a non-finite gradient      |
    | ``ft/batches_committed``           | torchft's count: the sum of participants over committed steps        |
    | ``ft/heals``                       | heals of this group, in this process                                 |
    | ``ft/heal_seconds``                | the latest heal's duration (receive + apply); from the first heal on |
    | ``ft/quorum_wait_seconds``         | how long this step's training thread waited for its quorum           |
    | ``ft/quorum_wait_seconds_total``   | all quorum waits of this process, sync sections included             |
    | ``ft/data_refetches``              | ``data_mode="exactly_once"`` only: batches read again in this        |
    |                                    | process because the loader's prediction of the placement was wrong   |

    **Progress bar.** ``replicas P/N`` (participants of the latest quorum / ``num_replica_groups``), through the
    progress bar's ``get_metrics``, Lightning's documented place to add items. It is wrapped on the progress bar
    instance for the duration of the run, so TQDM, Rich and a user's own progress bar all show it, and a user's own
    ``get_metrics`` override keeps working. Every group's rank 0 shows its own bar.

    Lightning's own bars (TQDM and Rich) count the epoch's *committed* batches: a batch whose step did not commit
    (a failed vote, a skipped non-finite step) is one Lightning ran but the job did not take, and Lightning's count
    would otherwise end past its total (``401/400``). (Semi-synchronous training commits per sync, not per batch:
    its bar counts batches as usual.)

    **Exceptions.** An exception that ends the run is recorded as an ``exception`` event (its type, message and the
    committed step), for ``lightning-ft report``.

    Args:
        progress_bar: Show ``replicas P/N`` in the progress bar.
    """

    def __init__(self, progress_bar: bool = True) -> None:
        self.progress_bar = progress_bar
        self._heals_logged = 0
        self._patches = LoopPatches()

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wrap the progress bar: ``replicas P/N`` among its metrics, and Lightning's own bars count committed
        batches."""
        self._heals_logged = 0
        bar = trainer.progress_bar_callback
        self._patches.undo()
        if self.progress_bar and bar is not None:
            self._show_replicas(bar)
        if isinstance(bar, (TQDMProgressBar, RichProgressBar)) and not is_semi_sync(trainer):
            self._count_committed_batches(bar)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The job's logger owner (rank 0 of group 0) leaves a pointer to the run's event log in its logger's
        directory, once the logger has made it (:func:`lightning_ft_job.events.point_log_dir_at_run`): what
        ``lightning-ft report <the logger's directory>`` follows."""
        if rank_zero_only.rank == 0 and has_ft_manager(trainer):  # type: ignore[attr-defined]  # set by Lightning at run time
            events.point_log_dir_at_run(_logger_directory(trainer))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo the progress bar's wrapping."""
        self._patches.undo()

    def _show_replicas(self, bar: ProgressBar) -> None:
        def make(get_metrics: Callable[[pl.Trainer, pl.LightningModule], dict[str, Any]]) -> Callable[..., Any]:
            def with_replicas(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
                items = get_metrics(trainer, pl_module)
                telemetry = ft_telemetry(trainer)
                replicas = telemetry.replicas() if telemetry is not None else None
                return items if replicas is None else {"replicas": replicas, **items}

            return with_replicas

        self._patches.wrap(bar, "get_metrics", make)

    def _count_committed_batches(self, bar: ProgressBar) -> None:
        """Hand the bar the batch index less this epoch's uncommitted steps (counted in this process)."""
        uncommitted_at_epoch_start = 0

        def uncommitted() -> int:
            telemetry = ft_telemetry(bar.trainer) if has_ft_manager(bar.trainer) else None
            return telemetry.uncommitted_steps if telemetry is not None else 0

        def make_epoch_start(on_train_epoch_start: Callable[..., Any]) -> Callable[..., Any]:
            def remembering(*args: Any, **kwargs: Any) -> Any:
                nonlocal uncommitted_at_epoch_start
                uncommitted_at_epoch_start = uncommitted()
                return on_train_epoch_start(*args, **kwargs)

            return remembering

        def make_batch_end(on_train_batch_end: Callable[..., Any]) -> Callable[..., Any]:
            def committed_only(
                trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
            ) -> Any:
                lost = uncommitted() - uncommitted_at_epoch_start
                return on_train_batch_end(trainer, pl_module, outputs, batch, max(batch_idx - lost, 0))

            return committed_only

        self._patches.wrap(bar, "on_train_epoch_start", make_epoch_start)
        self._patches.wrap(bar, "on_train_batch_end", make_batch_end)

    # ------------------------------------------------------------------ metrics
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Give every logger the ``ft/`` metrics when Lightning logs this batch's, or when this group has healed since
        they were last logged (nothing without a logger or a Manager)."""
        if not trainer.loggers or not has_ft_manager(trainer):
            return
        telemetry = ft_telemetry(trainer)
        heals = len(telemetry.heals) if telemetry is not None else 0
        if not (lightning_internals.should_update_logs(trainer) or heals > self._heals_logged):
            return
        self._heals_logged = heals
        metrics = self.metrics(trainer)
        step = lightning_internals.batches_that_stepped(trainer)  # where Lightning logs this batch (as LR monitor)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @staticmethod
    def metrics(trainer: pl.Trainer) -> dict[str, float]:
        """The ``ft/`` metrics now. Reads counters only: no collective, no device work, no waiting on a quorum.

        Args:
            trainer: A trainer whose strategy runs a torchft Manager.

        Returns:
            Each metric's value by its ``ft/`` name (the table above); the optional ones only where they exist.

        Raises:
            StrategyRequiredError: The strategy has no torchft Manager (not FTStrategy, or not fitting, validating
                or testing).
        """
        manager = ft_manager(trainer)
        values: dict[str, float] = {
            "committed_steps": manager.current_step(),
            "batches_committed": manager.batches_committed(),
        }
        telemetry = ft_telemetry(trainer)
        if telemetry is not None:
            if telemetry.participants is not None:
                values["participants"] = telemetry.participants
            if telemetry.quorum_id is not None:
                values["quorum_id"] = telemetry.quorum_id
            values["uncommitted_steps"] = telemetry.uncommitted_steps
            values["heals"] = len(telemetry.heals)
            if telemetry.heals:
                values["heal_seconds"] = telemetry.heals[-1].seconds
            values["quorum_wait_seconds"] = telemetry.step_quorum_wait_seconds
            values["quorum_wait_seconds_total"] = telemetry.quorum_wait_seconds_total
        with contextlib.suppress(RuntimeError):  # a strategy without a StepProtocol
            values["non_finite_skips"] = ft_step_protocol(trainer).non_finite_skips
        data = ft_exactly_once_data(trainer)
        if data is not None:
            values["data_refetches"] = data.refetches
        return {PREFIX + name: float(value) for name, value in values.items()}

    # ------------------------------------------------------------------ failures
    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Record the exception that ends the run as an ``exception`` event (type, message, committed step)."""
        step = ft_manager(trainer).current_step() if has_ft_manager(trainer) else None
        events.emit("exception", step=step, type=type(exception).__name__, message=str(exception)[:1000])


def _logger_directory(trainer: pl.Trainer) -> str | None:
    """The first logger's local directory (``log_dir``, the versioned one, else ``save_dir``), read directly:
    ``Trainer.log_dir`` broadcasts inside the group, which only rank 0 reaches here."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    getattr(logger, "experiment", None)  # made now if not yet: a logger warns when its new directory holds a file
    directory = getattr(logger, "log_dir", None) or logger.save_dir
    return None if directory is None else str(directory)

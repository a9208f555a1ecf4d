"""What FTStrategy builds for a fit, validation or test once the group's processes exist, and ends at teardown.

One object per run of the Trainer, built in one place and in one order (:func:`build_fit_parts`): this group's
Manager (torchft) and its telemetry; while fitting, the step protocol and the step's owner, the default callbacks and
the job's start (resume, or heal from a live peer); the job-wide collectives; while fitting, the check of the job's
contract. The strategy holds this one reference (``FTStrategy.manager``, ``step_protocol``, ... read from it), and
:meth:`FitParts.shutdown` ends what it started.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ft.algorithms.sync_owner import SyncOwner
from lightning_ft.callbacks import add_default_callbacks
from lightning_ft.manager import FTManager, ManagerHandle, build_manager
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.signals import SigtermDeadline
from lightning_ft.start.contract import install_contract_check
from lightning_ft.start.job_settings import strategy_contract
from lightning_ft.start.last_step import deferred_last_step
from lightning_ft.start.lifecycle import GroupLifecycle
from lightning_ft.step.buffers import ModelBuffers
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.owner import StepOwner
from lightning_ft.step.protocol import StepProtocol
from lightning_ft_job import events
from lightning_ft_job.environment import torchrun_restart_count

if TYPE_CHECKING:
    from lightning_ft.loop_patches import LoopPatches
    from lightning_ft.strategy_arguments import FTStrategyArguments


@dataclass
class FitParts:
    """This group's part of the job while the Trainer runs. ``protocol`` exists while fitting, with the one
    ``owner`` of the fit's steps: a :class:`~lightning_ft.step.owner.StepOwner` per step (``algorithm="ddp"``), a
    :class:`~lightning_ft.algorithms.sync_owner.SyncOwner` semi-synchronously; ``lifecycle``, the job's record through
    the fit, while fitting."""

    handle: ManagerHandle
    telemetry: FTTelemetry
    collectives: CrossGroupCollectives
    protocol: StepProtocol | None = None
    owner: StepOwner | SyncOwner | None = None
    lifecycle: GroupLifecycle | None = None

    @property
    def manager(self) -> FTManager:
        return self.handle.manager

    def shutdown(self) -> None:
        """Shut the Manager down: its servers, its lighthouse connection, its process group."""
        self.handle.shutdown()


def build_fit_parts(
    strategy: FTStrategyArguments,
    trainer: pl.Trainer,
    patches: LoopPatches,
    sigterm_deadline: SigtermDeadline,
    ddp_kwargs: Mapping[str, Any],
) -> FitParts:
    """Build this group's parts in order. While fitting, the job's record is read first: a group of a finished run
    exits before it registers with the lighthouse. A failure after the Manager started (the job's start refused, a
    peer's contract differs) shuts it down before it propagates: nothing of the group outlives the error."""
    fitting, settings = trainer.state.fn == TrainerFn.FITTING, strategy.settings
    run = strategy.broadcast(events.run_id())  # the group's ranks agree on rank 0's (Lightning's launcher sets none)
    # The event log is the run's: under default_root_dir when a launcher gave the run an id (its restarts read the
    # run's end there); a fit no launcher started writes one only where LIGHTNING_FT_EVENTS_DIR asks.
    log_root = trainer.default_root_dir if events.given_run_id() else None
    events.configure(settings.replica_group_id, strategy.global_rank, log_root, run)
    lifecycle = None
    if fitting:
        lifecycle = GroupLifecycle(trainer, settings, strategy.global_rank, strategy.broadcast, run)
        lifecycle.exit_if_job_finished(trainer)
    sigterm_deadline.install()  # before Lightning's own SIGTERM handler, which then calls this one too
    handle = build_manager(
        settings, strategy.global_rank, strategy.world_size, strategy.root_device, num_nodes=strategy.num_nodes
    )
    try:
        manager = handle.manager
        telemetry = FTTelemetry(manager, handle.transport, settings.num_replica_groups)
        protocol = None
        if lifecycle is not None:
            protocol = StepProtocol(manager, telemetry, _model_buffers(strategy, manager))
            protocol.check_before_vote(lifecycle.last_step_check(trainer).before_vote)
        expected_groups = settings.num_replica_groups if settings.world_size_mode == "dynamic" else None
        position = _section_position(trainer, manager, protocol)
        collectives = CrossGroupCollectives(manager, protocol, position, expected_groups=expected_groups)
        owner: StepOwner | SyncOwner | None = None
        if protocol is not None and strategy.algorithm.semi_sync:
            owner = SyncOwner(protocol, collectives, strategy.algorithm, lambda: deferred_last_step(manager))
        elif protocol is not None:
            sharded = strategy.data_parallel.sharded
            owner = StepOwner(protocol, skip_non_finite=settings.skip_non_finite_steps, sharded=sharded)
        if lifecycle is not None and protocol is not None:
            add_default_callbacks(
                trainer,
                semi_sync=strategy.algorithm.semi_sync,
                exactly_once=strategy.data_mode == "exactly_once",
                several_groups=settings.num_replica_groups > 1,
            )
            replica_groups = settings.num_replica_groups
            events.emit(
                "started", attempt=torchrun_restart_count(), ppid=os.getppid(), replica_groups=replica_groups, run=run
            )
            lifecycle.start_where_the_job_is(trainer, protocol, patches)
            own = strategy_contract(
                settings,
                strategy.algorithm,
                strategy.data_parallel,
                strategy.data_mode,
                ddp_kwargs,
                strategy.world_size,
            )
            install_contract_check(trainer, own, manager, settings.replica_group_id, settings.num_replica_groups)
        return FitParts(handle, telemetry, collectives, protocol, owner, lifecycle)
    except BaseException:
        handle.shutdown()
        raise


def _model_buffers(strategy: FTStrategyArguments, manager: FTManager) -> ModelBuffers | None:
    """The model's buffers, averaged across the job at each vote, unless ``buffer_sync="off"``."""
    if strategy.settings.buffer_sync == "off":
        return None
    module = strategy.lightning_module
    assert module is not None
    semi_sync = strategy.algorithm.semi_sync
    return ModelBuffers(
        module,
        manager,
        group_size=strategy.world_size,
        restore_on_reject=not semi_sync,
        at_batch_end=not semi_sync and not module.automatic_optimization,
    )


def _section_position(
    trainer: pl.Trainer, manager: FTManager, protocol: StepProtocol | None
) -> Callable[[], tuple[int, int, int]]:
    """Where this group is when it enters a sync section: committed step, epoch, batches read in this fit."""

    def position() -> tuple[int, int, int]:
        if protocol is None:
            return manager.current_step(), 0, 0
        batches = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        return manager.current_step(), trainer.current_epoch, batches

    return position

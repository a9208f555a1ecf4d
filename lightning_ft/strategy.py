"""FTStrategy: Lightning data parallelism inside a replica group, torchft fault tolerance across groups.

A job is N replica groups, each an ordinary Lightning DDP (or FSDP2) world whose torch default process group never
leaves the group. One torchft Manager per group (:mod:`lightning_ft.manager`) connects the groups: a quorum of live
groups each step, gradients averaged between them (:mod:`lightning_ft.step`), a vote on whether the step commits, and
the whole training state streamed to a group that is behind. This class holds properties and hook overrides only, in
the manner of Lightning's ``DDPStrategy``: its group-local hooks delegate to DDP or FSDP2 inside the group
(:mod:`lightning_ft.group_parallelism`), and what a fit builds is one object (:mod:`lightning_ft.fit_parts`).
``docs/architecture.md`` follows one step and one heal through the package.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ft import lightning_internals, loop_patches
from lightning_ft.algorithms.config import warn_unsynced_tail
from lightning_ft.algorithms.sync_owner import SyncOwner
from lightning_ft.checkpoint_io import load_checked
from lightning_ft.data.exactly_once_training import ExactlyOnceTraining
from lightning_ft.data.job_shard import JobShard, fit_sampler_to_job, forget_job_shard, publish_job_shard
from lightning_ft.data.placement import ExactlyOnceData
from lightning_ft.data.sidecars import remove_sidecars, save_own_position, use_own_position
from lightning_ft.errors import NotAvailableError, attached_module
from lightning_ft.fit_parts import FitParts, build_fit_parts
from lightning_ft.group_parallelism import GroupParallelism, group_parallelism
from lightning_ft.heal.state import state_fingerprint
from lightning_ft.hsdp.cross_group import ShardAverage
from lightning_ft.manager import FTManager
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.start.job_settings import refuse_group_local_settings
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.gradient_hooks import install_ddp_cross_group_hook
from lightning_ft.step.modes import check_nothing_unfrozen, check_optimizers
from lightning_ft.step.owner import StepOwner
from lightning_ft.step.protocol import StepProtocol
from lightning_ft.step.unfinished_reduction import reword_ddp_reduction_error
from lightning_ft.step.unused_parameter_note import first_forward_without_torch_note
from lightning_ft.strategy_arguments import FTStrategyArguments
from lightning_ft_job import events

_RUNS_A_MANAGER = (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING)


class FTStrategy(FTStrategyArguments):
    """Fault-tolerant data parallelism across replica groups with torchft.

    Use it like ``DDPStrategy``: ``Trainer(strategy=FTStrategy())``, ``Trainer(strategy="ft")``, or
    ``class_path: lightning_ft.FTStrategy`` in LightningCLI YAML. Start each replica group with the same script;
    ``lightning-ft launch`` does that on one machine. Its arguments are defined, each once, by
    :class:`~lightning_ft.strategy_arguments.FTStrategyArguments`; ``docs/configuration.md`` describes each in full.

    Attributes:
        strategy_name: ``"ft"``, its name in Lightning's strategy registry (``Trainer(strategy="ft")``).
        settings: The resolved torchft settings (the arguments, defaults and environment variables applied); beside
            it, the attributes ``algorithm``, ``data_parallel`` and ``data_mode`` hold those resolved values.
        heal_mode: Open while a heal builds or restores Lightning's checkpoint (the methods serve this process's own).
    """

    strategy_name = "ft"
    _fit: FitParts | None = None  # what setup_environment built, until teardown

    @functools.cached_property
    def _in_group(self) -> GroupParallelism:
        """DDP or FSDP2 inside the group (:mod:`lightning_ft.group_parallelism`), chosen once by ``data_parallel``."""
        return group_parallelism(self.data_parallel, self._shard_average)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"ft"`` in Lightning's strategy registry (``import lightning_ft`` does it), replacing any entry
        of that name."""
        description = "Fault-tolerant data parallelism across replica groups (torchft)"
        strategy_registry.register(cls.strategy_name, cls, description=description, override=True)

    # ------------------------------------------------------------------ what callbacks read (callbacks/_access.py)
    @property
    def _module(self) -> pl.LightningModule:
        """``lightning_module``, which Lightning attaches before it calls any hook that reads this."""
        return attached_module(self)

    def _parts(self, name: str, while_: str = "fitting, validating or testing") -> FitParts:
        if self._fit is None:
            raise NotAvailableError(f"FTStrategy.{name} is only available while {while_}, after setup_environment().")
        return self._fit

    @property
    def manager(self) -> FTManager:
        """This group's torchft Manager, while fitting, validating or testing (else ``NotAvailableError``)."""
        return self._parts("manager").manager

    @property
    def collectives(self) -> CrossGroupCollectives:
        """Job-wide reductions over every participating replica (:mod:`lightning_ft.step.collectives`), while
        fitting, validating or testing (else ``NotAvailableError``)."""
        return self._parts("collectives").collectives

    @property
    def telemetry(self) -> FTTelemetry:
        """This group's fault-tolerance figures (quorum waits, heals, votes), in a fit, validation or test."""
        return self._parts("telemetry").telemetry

    @property
    def step_protocol(self) -> StepProtocol:
        """The fit's exchange with the Manager (:mod:`lightning_ft.step.protocol`) while fitting, else an error."""
        protocol = self._parts("step_protocol", "fitting").protocol
        if protocol is None:
            raise NotAvailableError("FTStrategy.step_protocol is only available while fitting.")
        return protocol

    @property
    def step_owner(self) -> StepOwner | SyncOwner:
        """The one owner of the fit's steps, while fitting (else ``NotAvailableError``): of each optimizer step
        (:mod:`lightning_ft.step.owner`), or each semi-synchronous sync (:mod:`lightning_ft.algorithms.sync_owner`)."""
        owner = self._parts("step_owner", "fitting").owner
        if owner is None:
            raise NotAvailableError("FTStrategy.step_owner is only available while fitting.")
        return owner

    @property
    def exactly_once_data(self) -> ExactlyOnceData | None:
        """With ``data_mode="exactly_once"`` while fitting: the schedule, the last step's placement, the refetches."""
        return self._exactly_once.data

    @property
    def device_mesh(self) -> DeviceMesh:
        """The group's 1-D mesh with ``data_parallel="fsdp"`` (also ``LightningModule.device_mesh``), else an error."""
        if self._in_group.device_mesh is None:
            raise NotAvailableError("FTStrategy.device_mesh needs data_parallel='fsdp', after setup_environment().")
        return self._in_group.device_mesh

    @property
    def replica_group_id(self) -> int:
        """This replica group's id, in ``[0, num_replica_groups)``."""
        return self.settings.replica_group_id

    @property
    def num_replica_groups(self) -> int:
        """The most replica groups the job has."""
        return self.settings.num_replica_groups

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this process writes the job's checkpoints: rank 0 of the lowest-numbered group in the quorum (never
        a healing one); outside fitting, or with one group, group 0's rank 0 (before any quorum: ``Tuner.lr_find``)."""
        if self.global_rank != 0 or self._fit is None or self._fit.protocol is None or self.num_replica_groups == 1:
            return self.global_rank == 0 and self.replica_group_id == 0
        return self._fit.manager.participating_rank() == 0

    def start_quorum(self) -> None:
        """Begin the current optimizer step now, as its owner does at the latest in ``on_train_batch_start``: its
        quorum opens (a behind group heals here with synchronous quorum), the step counters go on the committed
        count; a no-op once begun. Per-step training only (``NotAvailableError``: a sync opens its own quorum)."""
        if not isinstance(owner := self.step_owner, StepOwner):
            raise NotAvailableError("FTStrategy.start_quorum: a semi-synchronous fit's syncs open their own quorums.")
        owner.begin(self._module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Begin the step: Lightning calls this after every callback's ``on_train_batch_start``, so the quorum is
        open by the forward pass whatever callbacks the trainer has (``QuorumCallback`` opens it earlier)."""
        if self._fit is not None and isinstance(self._fit.owner, StepOwner):  # a sync's: SyncCallback's own hook
            self._fit.owner.begin(self._module.trainer)

    # ------------------------------------------------------------------ ranks and data
    @override
    def set_world_ranks(self) -> None:
        """Ranks stay group-local; Lightning's rank-zero rule (loggers, messages) becomes job-wide: rank 0 of group 0
        only, as in plain DDP. Data code learns its job-wide shard from :func:`lightning_ft.job_shard`."""
        super().set_world_ranks()
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.job_shard.rank  # type: ignore[attr-defined]  # Lightning's own rank-zero attribute

    @property
    def job_shard(self) -> JobShard:
        """This process among every process of the job: ``num_replica_groups × group size`` ranks, ordered by
        group, then rank (what :func:`lightning_ft.job_shard` answers during the fit)."""
        size = self.num_nodes * self.num_processes
        return JobShard(rank=self.replica_group_id * size + self.global_rank, world_size=self.num_replica_groups * size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """A ``DistributedSampler``'s ``num_replicas`` and ``rank``: the job's world and this process's rank in it."""
        return {"num_replicas": self.job_shard.world_size, "rank": self.job_shard.rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A ``DistributedSampler`` built for the group's world is re-sharded to the job's
        (:func:`~lightning_ft.data.job_shard.fit_sampler_to_job`); with ``data_mode="exactly_once"`` the training
        loader is rebuilt to read the samples each committed step assigns.

        Raises:
            FTConfigError: A group-world sampler that cannot be re-sharded; with exactly-once data, a training
                loader it cannot rebuild (not a ``DataLoader``, an ``IterableDataset``, no ``batch_size``).
        """
        if not self._exactly_once.building_train_loader:
            fit_sampler_to_job(dataloader, self.job_shard, JobShard(rank=self.global_rank, world_size=self.world_size))
            return super().process_dataloader(dataloader)
        return self._exactly_once.train_loader(
            dataloader, self.settings, self.world_size, self.global_rank, self.manager
        )

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """With exactly-once data, a training batch begins the step and is checked against its quorum's samples."""
        trainer = self._module.trainer
        if self._exactly_once.data is not None and trainer.training:
            self.step_owner.begin(trainer)
            batch = self._exactly_once.batch_for_step(batch, trainer, self.manager, dataloader_idx)
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        """As ``DDPStrategy``'s; while fitting, validating or testing, also this group's part of the job
        (:func:`~lightning_ft.fit_parts.build_fit_parts`): its event log, its Manager and, while fitting, the step
        protocol, the default callbacks and the job's start (resume, or heal from a live peer).

        Raises:
            JobAlreadyFinished: The run this group belongs to has already finished.
            LighthouseUnreachableError: The lighthouse does not accept a connection within ``connect_timeout``.
            FTConfigError: ``process_group="nccl"`` without CUDA, or a job's start the settings cannot make.
        """
        trainer = self._module.trainer
        super().setup_environment()
        self._in_group.setup_environment(self)
        if self._environment_before is None:  # for this fit (validate, test) and its DataLoader workers only
            self._environment_before = publish_job_shard(self.job_shard)
        if trainer.state.fn not in _RUNS_A_MANAGER:
            return
        self._fit = build_fit_parts(self, trainer, self._patches, self._sigterm_deadline, self._ddp_kwargs)
        self._lifecycle = self._fit.lifecycle or self._lifecycle  # kept after the fit: a save after fit() is recorded

    @override
    def _configure_launcher(self) -> None:
        """A one-process group has nothing to launch (Lightning's launcher would start an observer of no process)."""
        if self.num_processes == 1 and self.num_nodes == 1:
            self._launcher = None
            return
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        """A one-process group's store binds a free port itself: a ``MASTER_PORT`` chosen by torchrun or Lightning
        may be taken before this process binds it (EADDRINUSE, a wasted restart)."""
        if self.world_size == 1:
            os.environ["MASTER_PORT"] = "0"
        with loop_patches.without_process_group_banner():
            super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """As ``DDPStrategy``'s (FSDP2 sharding instead of DDP with ``data_parallel="fsdp"``); while fitting, refuse
        what cannot work and make Lightning's loops count committed steps (``loop_patches.prepare_the_fit``).

        Raises:
            FTConfigError: A setting the fit cannot honour (LBFGS per step, a time-based ``val_check_interval``
                across groups, exactly-once data with gradient accumulation); the message names it.
            UnsupportedModelError: With FSDP, parameters that FSDP2 does not manage after sharding.
        """
        self._in_group.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            check_optimizers(self.optimizers, semi_sync=self.algorithm.semi_sync)
            refuse_group_local_settings(trainer, self.num_replica_groups)
            if self.algorithm.semi_sync:  # LR schedulers follow inner steps, which always happen
                warn_unsynced_tail(self.algorithm, trainer.max_steps)
            per_step = self._fit.owner if self._fit is not None and isinstance(self._fit.owner, StepOwner) else None
            record = self._lifecycle.record if self._lifecycle is not None else None
            loop_patches.prepare_the_fit(self._patches, trainer, per_step, record, self.num_replica_groups)
            if self.data_mode == "exactly_once":
                self._exactly_once.prepare(trainer, self._patches)
        if self._fit is not None:
            loop_patches.cross_groups_where_every_group_is(self._patches, trainer, self._fit.collectives)

    def _shard_average(self, module: Module) -> ShardAverage:
        """HSDP's cross-group average of the sharded ``module``'s gradients, in the step's quorum."""
        return ShardAverage(module, self.manager, self.root_device, self.step_protocol.before_cross_group_allreduce)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:  # or the model as it is
        """torch's DDP refuses a model with no trainable parameter (frozen at the start): it stays unwrapped."""
        self._frozen_at_start = not any(parameter.requires_grad for parameter in model.parameters())
        return model if self._frozen_at_start else super()._setup_model(self._choose_unused_search(model))  # type: ignore[return-value]

    @override
    def _register_ddp_hooks(self) -> None:
        """The cross-group comm hook; none between semi-synchronous syncs (inner steps stay in the group)."""
        if isinstance(self.model, DistributedDataParallel) and not self.algorithm.semi_sync:
            self._comm_state = install_ddp_cross_group_hook(
                self.model, self.manager, self.step_protocol, self.world_size, self.num_replica_groups > 1
            )

    # ------------------------------------------------------------------ job-wide reductions
    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce over every participating replica where every group makes the same collectives (an optimizer step,
        validation and test, an epoch end); elsewhere, and with an explicit ``group``, inside the group.

        Raises:
            UnsupportedArgumentError: Across groups, a ``reduce_op`` other than sum, mean, max, min and product.
        """
        if not isinstance(tensor, Tensor) or group is not None or self._fit is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return self._fit.collectives.reduce(tensor, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether ``decision`` holds in every participating process of the job (in any, with ``all=False``): so
        ``EarlyStopping`` and ``ModelCheckpoint`` decide alike in every group."""
        if self._fit is None:
            return super().reduce_boolean_decision(decision, all=all)
        return self._fit.collectives.decide(decision, require_all=all)

    @override
    def on_validation_start(self) -> None:
        """Every group validates at the same committed step, so validation's reductions may cross groups (not in the
        sanity check, which a restarted group runs while its peers train)."""
        if self._fit is not None and not self._module.trainer.sanity_checking:
            self._fit.collectives.open_section()

    @override
    def on_test_start(self) -> None:
        """As :meth:`on_validation_start`, for testing."""
        self.on_validation_start()

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """As ``DDPStrategy``'s; the step owner reads the loss it returns."""
        note, self._torch_note_pending = self._torch_note_pending, False
        with first_forward_without_torch_note() if note else nullcontext():
            output = super().training_step(*args, **kwargs)
        if self._fit is not None and isinstance(self._fit.owner, StepOwner):
            self._fit.owner.saw_output(output)
        return output

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The step owner's while fitting per step: the closure runs, the groups vote, the optimizer steps only on a
        commit. A semi-synchronous inner step is the group's own, always taken (its syncs commit or not).

        Raises:
            FTConfigError: A model frozen at the start (left without DDP) now has a gradient, in a multi-process job.
        """
        if self._frozen_at_start and self.job_shard.world_size > 1:
            check_nothing_unfrozen(self._module)
        if self._fit is None or not isinstance(self._fit.owner, StepOwner):  # semi-sync, or no fit: as in DDP
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self._module
        assert isinstance(model, pl.LightningModule)  # as Lightning's Strategy.optimizer_step asserts
        return self._fit.owner.step(optimizer, closure, model, self.precision_plugin, self._comm_state, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """As ``DDPStrategy``'s; then what the group left out gets the job's average; the vote's fence is marked."""
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._comm_state is not None:  # lightning_ft.step.left_out_parameters
            self._comm_state.backward_done()
        self._in_group.backward_done()  # HSDP: lightning_ft.hsdp.cross_group
        if self._fit is not None and isinstance(self._fit.owner, StepOwner) and self._module.automatic_optimization:
            self._fit.owner.backward_done(closure_loss, self._comm_state)  # the loss as given: before any scaling
        return output

    # ------------------------------------------------------------------ inside the group: DDP or FSDP2
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient sync inside the group while accumulating (DDP's ``no_sync``, or FSDP2's equivalent)."""
        with self._in_group.block_backward_sync(self):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint (FSDP: the full state, for group rank 0); in a heal, this process's."""
        if self.heal_mode.is_open:
            return self.heal_mode.model_state(DDPStrategy.lightning_module_state_dict(self))
        return self._in_group.lightning_module_state_dict(self)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """An optimizer's state for a checkpoint (FSDP: the full state by parameter name); in a heal, this process's."""
        if self.heal_mode.is_open:
            return self.heal_mode.optimizer_state(DDPStrategy.optimizer_state(self, optimizer))
        return self._in_group.optimizer_state(self, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the model's state (FSDP: a full state into the shards); in a heal, this process's own."""
        if self.heal_mode.is_open:
            DDPStrategy.load_model_state_dict(self, checkpoint, strict=strict)
        else:
            self._in_group.load_model_state_dict(self, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizers' state (FSDP: a full state into the shards); in a heal, this process's own."""
        if self.heal_mode.is_open:
            DDPStrategy.load_optimizer_state_dict(self, checkpoint)
        else:
            self._in_group.load_optimizer_state_dict(self, checkpoint)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: lightning_internals.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write only on the single checkpoint writer, crash-safely, and only forward (not a state older than the
        newest in the file's directory); every rank also writes its own data position beside it."""
        step, writer = int(checkpoint.get("global_step", 0)), self.is_checkpoint_writer
        if self._lifecycle is not None and self._lifecycle.refuses_save(filepath, step, writer):
            return
        save_own_position(checkpoint, filepath, self.replica_group_id, self.global_rank, is_writer=writer)
        if writer:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if self._lifecycle is not None:
                self._lifecycle.record.record_save(filepath, step)
            events.emit("checkpoint_saved", path=str(filepath), step=checkpoint.get("global_step"))

    @override
    def remove_checkpoint(self, filepath: lightning_internals.PathLike) -> None:
        """On the checkpoint writer only: remove the checkpoint, its data-position sidecars and its record entry."""
        if self.is_checkpoint_writer:
            self.checkpoint_io.remove_checkpoint(filepath)
            remove_sidecars(filepath)
            if self._lifecycle is not None:
                self._lifecycle.record.record_removal(filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: lightning_internals.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the shared checkpoint (``weights_only=True`` unless asked otherwise: the files hold plain data) with
        this rank's own data position from its sidecar.

        Raises:
            UnreadableCheckpointError: The file is corrupt or truncated, holds an object a ``weights_only`` load
                refuses, or is not a Lightning checkpoint (:mod:`lightning_ft.checkpoint_io`).
            FileNotFoundError: No file at ``checkpoint_path``.
        """
        weights_only = True if weights_only is None else weights_only
        load = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        checkpoint = load_checked(checkpoint_path, load)
        use_own_position(checkpoint, checkpoint_path, self.replica_group_id, self.global_rank, weights_only)
        return checkpoint

    # ------------------------------------------------------------------ the end
    @override
    def on_train_end(self) -> None:
        """Record the job's end; the ``finished`` event, with the state's fingerprint if asked (FSDP gathers it)."""
        trainer = self._module.trainer
        if self._lifecycle is not None and self._fit is not None and self._fit.protocol is not None:
            self._lifecycle.record_the_end(trainer, self.manager.current_step())
        if events.enabled():
            fingerprint = {"fingerprint": state_fingerprint(trainer)} if events.requested() else {}
            events.emit("finished", step=self.manager.current_step(), global_step=trainer.global_step, **fingerprint)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """DDP's unfinished-reduction error names FTStrategy's setting (lightning_ft.step.unfinished_reduction)."""
        reword_ddp_reduction_error(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """As ``DDPStrategy``'s; then restore the job-shard variables, undo the patches, shut the Manager down."""
        super().teardown()
        if self._environment_before is not None:
            forget_job_shard(self._environment_before)
            self._environment_before = None
        self._sigterm_deadline.uninstall()
        self._patches.undo()
        self._comm_state, self._exactly_once = None, ExactlyOnceTraining()
        if self._fit is not None:
            self._fit.shutdown()
            self._fit = None

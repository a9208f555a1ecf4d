"""FTStrategy: Lightning data parallelism inside a replica group, torchft fault tolerance across groups.

A job is N replica groups, each an ordinary Lightning DDP (or FSDP2) world whose torch default process group never
leaves the group. One torchft Manager per group (:mod:`lightning_ft.manager`) connects the groups: a quorum of live
groups each step, gradients averaged between them (:mod:`lightning_ft.step`), a vote on whether the step commits, and
the whole training state streamed to a group that is behind. This class holds properties and hook overrides only, in
the manner of Lightning's ``DDPStrategy``; its group-local hooks delegate to DDP or FSDP2 inside the group
(:mod:`lightning_ft.group_parallelism`);
``docs/architecture.md`` follows one step and one heal through the package.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
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

from lightning_ft import lightning_internals as lightning
from lightning_ft import loop_patches
from lightning_ft.algorithms import OuterOptimizerFactory
from lightning_ft.algorithms.config import warn_unsynced_tail
from lightning_ft.callbacks import add_default_callbacks
from lightning_ft.checkpoint_io import AtomicCheckpointIO, load_checked
from lightning_ft.configuration import resolve_configuration
from lightning_ft.data.exactly_once_training import ExactlyOnceTraining
from lightning_ft.data.job_shard import JobShard, fit_sampler_to_job, forget_job_shard, publish_job_shard
from lightning_ft.data.placement import ExactlyOnceData
from lightning_ft.data.sidecars import remove_sidecars, save_own_position, use_own_position
from lightning_ft.errors import NotAvailableError
from lightning_ft.group_parallelism import GroupParallelism, group_parallelism
from lightning_ft.heal.checkpoint_mode import HealCheckpointMode
from lightning_ft.heal.state import state_fingerprint
from lightning_ft.manager import FTManager, ManagerHandle, build_manager
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.settings import (
    AlgorithmName,
    BufferSyncName,
    DataModeName,
    DataParallelName,
    ProcessGroupName,
    TransportName,
    WorldSizeModeName,
)
from lightning_ft.signals import SigtermDeadline
from lightning_ft.start.contract import install_contract_check
from lightning_ft.start.job_settings import refuse_group_local_settings, strategy_contract
from lightning_ft.start.lifecycle import GroupLifecycle
from lightning_ft.step.buffers import ModelBuffers
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.gradient_hooks import FTCommState, fsdp_cross_group_hook, install_ddp_cross_group_hook
from lightning_ft.step.modes import check_nothing_unfrozen, check_optimizers
from lightning_ft.step.owner import StepOwner
from lightning_ft.step.protocol import StepProtocol
from lightning_ft.step.unused_parameter_note import first_forward_without_torch_note
from lightning_ft_job import events
from lightning_ft_job.environment import torchrun_restart_count

_RUNS_A_MANAGER = (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING)


class FTStrategy(DDPStrategy):
    """Fault-tolerant data parallelism across replica groups with torchft.

    Use it like ``DDPStrategy``: ``Trainer(strategy=FTStrategy())``, ``Trainer(strategy="ft")``, or
    ``class_path: lightning_ft.FTStrategy`` in LightningCLI YAML. Start each replica group with the same script;
    ``lightning-ft launch`` does that on one machine. ``docs/configuration.md`` describes each argument in full.

    Args:
        replica_group_id: This group's id in ``[0, num_replica_groups)``. Default: env ``REPLICA_GROUP_ID``, else 0.
        num_replica_groups: The most groups of the job. Default: env ``NUM_REPLICA_GROUPS``, else 1.
        lighthouse: URL of the lighthouse shared by all groups. Default: env ``TORCHFT_LIGHTHOUSE``; with neither
            and a single group, one is started in this process.
        min_replica_size: A step commits only if at least this many groups took part in it.
        use_async_quorum: Form the quorum during the forward pass (a behind group heals inside the vote). Default
            ``True`` only for ``algorithm="ddp"`` with DDP and sharded data.
        timeout: Seconds for cross-group collectives, the commit vote and state transfer.
        quorum_timeout: Seconds to wait for a quorum; must exceed the time between two steps.
        connect_timeout: Seconds to connect to the lighthouse and the group's ManagerServer.
        init_sync: Heal every group from one peer at step 0, so groups may start from different random weights.
        max_retries: Stop after this many consecutive uncommitted steps. ``None`` retries forever.
        process_group: Backend between groups: ``"gloo"``, ``"nccl"``, or ``"auto"`` (NCCL on CUDA, else Gloo).
        checkpoint_transport: How a healing group receives state: ``"http"`` or ``"pg"``.
        hostname: Address this group advertises to the others. Default: env ``LIGHTNING_FT_HOSTNAME``.
        interface: Advertise this network interface's IPv4 address instead (env ``LIGHTNING_FT_INTERFACE``).
        replica_id_prefix: Prefix of the id registered with the lighthouse; the group id is appended.
        skip_non_finite_steps: Every replica skips a step whose averaged gradient has an inf or NaN.
        buffer_sync: ``"average"``: every vote averages the buffers' change (BatchNorm statistics) over the job, so
            every replica holds the same buffers; ``"off"``: each replica keeps its own (``docs/your-code.md``).
        lighthouse_outage_timeout: Seconds an external lighthouse may be unreachable (``None``: no limit).
        start_timeout: Seconds the first step waits for every group to start (``0``: none). Default: env
            ``LIGHTNING_FT_START_TIMEOUT``, else 300.
        world_size_mode: ``"dynamic"`` or ``"fixed_with_spares"`` (hot spares; ``docs/elasticity.md``).
        data_mode: ``"sharded"`` or ``"exactly_once"`` (``docs/elasticity.md``).
        algorithm: ``"ddp"``, ``"local_sgd"`` or ``"diloco"`` (``docs/semi-sync.md``).
        sync_every: Inner optimizer steps between two syncs (``local_sgd`` and ``diloco``).
        outer_optimizer: DiLoCo: ``{"class_path": ..., "init_args": {...}}`` or ``params -> Optimizer``.
        fragments: DiLoCo: a number of fragments, or lists of module names (streaming DiLoCo).
        fragment_sync_delay: DiLoCo: inner steps a fragment's allreduce may overlap.
        fragment_update_alpha: DiLoCo: in [0, 1]; 0 takes the new global parameters, 1 keeps the local ones.
        quantize: DiLoCo: quantise pseudo-gradients for the allreduce (CUDA and Triton).
        data_parallel: Inside a group: ``"ddp"`` or ``"fsdp"`` (FSDP2; HSDP across groups, ``docs/hsdp.md``).
        fsdp_wrap: FSDP: module classes that get their own ``fully_shard``, by class name or import path.
        fsdp_min_params: FSDP: also shard every module with at least this many parameters of its own.
        fsdp_mixed_precision: FSDP: ``MixedPrecisionPolicy`` fields, dtypes by name.
        fsdp_cpu_offload: FSDP: keep sharded parameters, gradients and optimizer state in CPU memory.
        fsdp_reshard_after_forward: FSDP: FSDP2's ``reshard_after_forward``.
        gradient_as_bucket_view: DDP: torch DDP's ``gradient_as_bucket_view`` (on by default).
        find_unused_parameters: DDP: torch DDP's ``find_unused_parameters``. ``None`` (the default): ``True``, which
            keeps one gradient bucket layout in every group, restarted ones included, with the allreduces overlapping
            the backward pass; torch's note about it is kept off the terminal, as the user did not set it.
        accelerator: As ``DDPStrategy``'s (Lightning sets it from the Trainer's ``accelerator``).
        parallel_devices: As ``DDPStrategy``'s: this group's devices (Lightning sets them from ``devices``).
        cluster_environment: As ``DDPStrategy``'s: how this group's processes find each other (torchrun, SLURM, ...).
        checkpoint_io: As ``DDPStrategy``'s. Default: crash-safe local writes (temporary file, fsync, rename).
        precision_plugin: As ``DDPStrategy``'s (Lightning sets it from ``precision``).
        process_group_backend: As ``DDPStrategy``'s: the backend inside the group (cross-group: ``process_group``).
        **kwargs: For ``DDPStrategy`` and torch's DDP (``bucket_cap_mb``, ``static_graph``, ...). A name that
            neither accepts raises :class:`~lightning_ft.FTConfigError` here, naming the nearest valid ones.

    Attributes:
        strategy_name: ``"ft"``, its name in Lightning's strategy registry (``Trainer(strategy="ft")``).
        settings: The resolved torchft settings: the arguments above, defaults and environment variables applied.
        algorithm: The resolved synchronisation across groups (``algorithm`` and its DiLoCo and LocalSGD options).
        data_parallel: The resolved parallelism inside a group (``data_parallel`` and its FSDP or DDP options).
        data_mode: ``"sharded"`` or ``"exactly_once"``.
        heal_mode: Open while a heal builds or restores Lightning's checkpoint: the checkpoint methods then serve
            this process's own state.

    Raises:
        FTConfigError: An argument has a value that cannot work, alone or with the others; the message names the
            argument and the fix.
    """

    strategy_name = "ft"

    def __init__(
        self,
        replica_group_id: int | None = None,
        num_replica_groups: int | None = None,
        lighthouse: str | None = None,
        min_replica_size: int = 1,
        use_async_quorum: bool | None = None,
        timeout: float = 60.0,
        quorum_timeout: float = 60.0,
        connect_timeout: float = 20.0,
        init_sync: bool = True,
        max_retries: int | None = None,
        process_group: ProcessGroupName = "auto",
        checkpoint_transport: TransportName = "http",
        hostname: str | None = None,
        interface: str | None = None,
        replica_id_prefix: str = "lightning_ft_",
        skip_non_finite_steps: bool = True,
        buffer_sync: BufferSyncName = "average",
        lighthouse_outage_timeout: float | None = 600.0,
        start_timeout: float | None = None,
        world_size_mode: WorldSizeModeName = "dynamic",
        data_mode: DataModeName = "sharded",
        algorithm: AlgorithmName = "ddp",
        sync_every: int | None = None,
        outer_optimizer: OuterOptimizerFactory | dict[str, Any] | None = None,
        fragments: int | list[list[str]] | None = None,
        fragment_sync_delay: int | None = None,
        fragment_update_alpha: float | None = None,
        quantize: bool = False,
        data_parallel: DataParallelName = "ddp",
        fsdp_wrap: list[str] | None = None,
        fsdp_min_params: int | None = None,
        fsdp_mixed_precision: dict[str, Any] | None = None,
        fsdp_cpu_offload: bool = False,
        fsdp_reshard_after_forward: bool | None = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        configuration = resolve_configuration(
            replica_group_id=replica_group_id,
            num_replica_groups=num_replica_groups,
            lighthouse=lighthouse,
            min_replica_size=min_replica_size,
            use_async_quorum=use_async_quorum,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            init_sync=init_sync,
            max_retries=max_retries,
            process_group=process_group,
            checkpoint_transport=checkpoint_transport,
            hostname=hostname,
            interface=interface,
            replica_id_prefix=replica_id_prefix,
            skip_non_finite_steps=skip_non_finite_steps,
            buffer_sync=buffer_sync,
            lighthouse_outage_timeout=lighthouse_outage_timeout,
            start_timeout=start_timeout,
            world_size_mode=world_size_mode,
            data_mode=data_mode,
            algorithm=algorithm,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            quantize=quantize,
            data_parallel=data_parallel,
            fsdp_wrap=fsdp_wrap,
            fsdp_min_params=fsdp_min_params,
            fsdp_mixed_precision=fsdp_mixed_precision,
            fsdp_cpu_offload=fsdp_cpu_offload,
            fsdp_reshard_after_forward=fsdp_reshard_after_forward,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            ddp_kwargs=dict(kwargs),  # a copy: LightningCLI's signature reader gives up on `name=kwargs`
            strategy_arguments=_OWN_ARGUMENTS,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            **configuration.ddp_kwargs,
        )
        self.settings = configuration.settings
        self.algorithm = configuration.algorithm
        self.data_parallel = configuration.data_parallel
        self.data_mode = configuration.data_mode
        self._unused_search_by_default = configuration.unused_search_by_default
        # Until the first training forward pass: torch's note about the search FTStrategy chose is kept off the
        # terminal there (lightning_ft.step.unused_parameter_note); no later step pays for it.
        self._torch_note_pending = self._unused_search_by_default
        self._in_group: GroupParallelism = group_parallelism(self.data_parallel, self._fsdp_cross_group_hook)
        # Open while a heal builds or restores Lightning's checkpoint: the checkpoint methods then serve this
        # process's own state (lightning_ft.heal.state).
        self.heal_mode = HealCheckpointMode()
        self._handle: ManagerHandle | None = None
        self._protocol: StepProtocol | None = None
        self._step: StepOwner | None = None
        self._telemetry: FTTelemetry | None = None
        self._collectives: CrossGroupCollectives | None = None
        self._patches = loop_patches.LoopPatches()
        self._sigterm_deadline = SigtermDeadline()
        self._comm_state: FTCommState | None = None
        self._exactly_once = ExactlyOnceTraining()
        # The job's record through the latest fit; kept after it, so that a save after fit() is recorded as well.
        self._lifecycle: GroupLifecycle | None = None
        # Whether the model had no trainable parameter when the fit wrapped it (it then stays unwrapped).
        self._frozen_at_start = False
        # The job-shard variables as they were before this fit published its own (restored at teardown).
        self._environment_before: dict[str, str | None] | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"ft"`` in Lightning's strategy registry (``import lightning_ft`` does it), replacing any entry
        of that name.

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Fault-tolerant data parallelism across replica groups (torchft)",
            override=True,
        )

    # ------------------------------------------------------------------ what callbacks read (callbacks/_access.py)
    @property
    def _module(self) -> pl.LightningModule:
        """``lightning_module``, which Lightning attaches before it calls any hook that reads this."""
        module = self.lightning_module
        if module is None:
            raise NotAvailableError("FTStrategy: no LightningModule is attached yet.")
        return module

    @property
    def device_mesh(self) -> DeviceMesh:
        """The replica group's 1-D mesh (``data_parallel="fsdp"`` only), also ``LightningModule.device_mesh``.

        Raises:
            NotAvailableError: Without ``data_parallel="fsdp"``, or before ``setup_environment()``.
        """
        mesh = self._in_group.device_mesh
        if mesh is None:
            raise NotAvailableError(
                "FTStrategy.device_mesh exists with data_parallel='fsdp', after setup_environment()."
            )
        return mesh

    @property
    def manager(self) -> FTManager:
        """This group's torchft Manager (exists from ``setup_environment`` on, while fitting, validating, testing).

        Raises:
            NotAvailableError: Outside fitting, validating and testing, or before ``setup_environment()``.
        """
        if self._handle is None:
            raise NotAvailableError(
                "FTStrategy.manager is only available while fitting, validating or testing, after setup_environment()."
            )
        return self._handle.manager

    @property
    def collectives(self) -> CrossGroupCollectives:
        """Job-wide reductions over every participating replica (see :mod:`lightning_ft.step.collectives`).

        Raises:
            NotAvailableError: Outside fitting, validating and testing, or before ``setup_environment()``.
        """
        if self._collectives is None:
            raise NotAvailableError("FTStrategy.collectives is only available after setup_environment().")
        return self._collectives

    @property
    def step_protocol(self) -> StepProtocol:
        """The fit's per-step protocol with the Manager: quorum, commit vote, step-start observers (see
        :mod:`lightning_ft.step.protocol`).

        Raises:
            NotAvailableError: Outside fitting, or before ``setup_environment()``.
        """
        if self._protocol is None:
            raise NotAvailableError(
                "FTStrategy.step_protocol is only available while fitting, after setup_environment()."
            )
        return self._protocol

    @property
    def step_owner(self) -> StepOwner:
        """The one owner of each optimizer step (``algorithm="ddp"``, while fitting): see
        :mod:`lightning_ft.step.owner`.

        Raises:
            NotAvailableError: Outside fitting, with a semi-synchronous ``algorithm``, or before
                ``setup_environment()``.
        """
        if self._step is None:
            raise NotAvailableError(
                "FTStrategy.step_owner is only available while fitting with algorithm='ddp', after setup_environment()."
            )
        return self._step

    @property
    def telemetry(self) -> FTTelemetry:
        """This group's fault-tolerance figures (quorum waits, heals, votes).

        Raises:
            NotAvailableError: Outside fitting, validating and testing, or before ``setup_environment()``.
        """
        if self._telemetry is None:
            raise NotAvailableError("FTStrategy.telemetry is only available while fitting, validating or testing.")
        return self._telemetry

    @property
    def exactly_once_data(self) -> ExactlyOnceData | None:
        """With ``data_mode="exactly_once"`` while fitting: the schedule, the last step's placement, the refetches;
        else ``None``."""
        return self._exactly_once.data

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
        """Whether this process writes the job's global checkpoints: rank 0 of the lowest-numbered group taking part
        in the current quorum (the duty moves on when that group dies; a healing group never writes). Outside
        fitting, and in a job of one group, group 0's rank 0."""
        if self.global_rank != 0:
            return False
        if self._handle is None or self._protocol is None or self.num_replica_groups == 1:  # a job of one group:
            return self.settings.replica_group_id == 0  # its rank 0, before the first quorum too (Tuner.lr_find)
        return self._handle.manager.participating_rank() == 0

    def start_quorum(self) -> None:
        """Open the quorum for the current optimizer step (no-op if already open).

        Raises:
            NotAvailableError: Outside fitting, or before ``setup_environment()``.
        """
        self.step_protocol.open_quorum()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Lightning calls this after every callback's ``on_train_batch_start``: the step's quorum is open by the
        forward pass whatever callbacks the trainer has (``QuorumCallback`` opens it earlier, before the others)."""
        if self._step is not None:
            self._step.begin(self._module.trainer)

    # ------------------------------------------------------------------ ranks and data
    @override
    def set_world_ranks(self) -> None:
        """Ranks stay group-local; Lightning's rank-zero rule (loggers, rank-zero messages) becomes job-wide: rank 0
        of group 0 only, as global rank 0 in plain DDP (every group's rank 0 would share one logger directory). Data
        code learns its job-wide shard from :func:`lightning_ft.job_shard`."""
        super().set_world_ranks()
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.job_shard.rank  # type: ignore[attr-defined]  # Lightning's own rank-zero attribute

    @property
    def job_shard(self) -> JobShard:
        """This process among every process of the job: ``num_replica_groups × group size`` ranks, ordered by
        group, then rank (what :func:`lightning_ft.job_shard` answers during the fit)."""
        group_size = self.num_nodes * self.num_processes
        return JobShard(
            rank=self.settings.replica_group_id * group_size + self.global_rank,
            world_size=self.settings.num_replica_groups * group_size,
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data as one big world of ``num_replica_groups × group size`` ranks, ordered by group, then rank.

        Returns:
            ``num_replicas`` (the job's world size) and ``rank`` (this process's job-wide rank), for a
            ``DistributedSampler``.
        """
        shard = self.job_shard
        return {"num_replicas": shard.world_size, "rank": shard.rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A user's ``DistributedSampler`` built for the group's world is re-sharded to the job's
        (:func:`~lightning_ft.data.job_shard.fit_sampler_to_job`). With exactly-once data, the training loader reads
        the samples the committed state assigns.

        Returns:
            The dataloader as DDP processes it, or, with ``data_mode="exactly_once"``, the training dataloader
            rebuilt to read the samples each committed step assigns.

        Raises:
            FTConfigError: A group-world sampler of a class that cannot be re-sharded; with exactly-once data, a
                training dataloader it cannot rebuild (not a ``DataLoader``, an ``IterableDataset``, no
                ``batch_size``, ``in_order=False``).
        """
        if not self._exactly_once.building_train_loader:
            group = JobShard(rank=self.global_rank, world_size=self.world_size)
            fit_sampler_to_job(dataloader, self.job_shard, group)
            return super().process_dataloader(dataloader)
        exactly_once = self._exactly_once
        return exactly_once.train_loader(dataloader, self.settings, self.world_size, self.global_rank, self.manager)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """With exactly-once data, a training batch is where the step's quorum opens (a behind group heals here) and
        where the batch is checked against the samples the quorum assigns.

        Returns:
            The batch on the device (with exactly-once data, the samples the step's quorum assigns).
        """
        trainer = self._module.trainer
        if self._exactly_once.data is not None and trainer.training:
            self.step_owner.begin(trainer)
            batch = self._exactly_once.batch_for_step(batch, trainer, self.manager, dataloader_idx)
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        """Set up the group's process group as ``DDPStrategy`` does; while fitting, validating or testing, also this
        group's torchft Manager (connected to the lighthouse), its event log and, while fitting, the step protocol,
        the default callbacks and the job's start (resume or heal from a live peer).

        Raises:
            JobAlreadyFinished: The run this group belongs to has already finished.
            LighthouseUnreachableError: The lighthouse does not accept a connection within ``connect_timeout``.
            FTConfigError: ``process_group="nccl"`` without a CUDA device, or a job's start that the settings
                cannot make (the message names it).
            NotAvailableError: No LightningModule is attached.
        """
        trainer = self._module.trainer
        super().setup_environment()
        self._in_group.setup_environment(self)
        if self._environment_before is None:  # for this fit (validate, test) and its DataLoader workers only
            self._environment_before = publish_job_shard(self.job_shard)
        if trainer.state.fn not in _RUNS_A_MANAGER:
            return
        fitting = trainer.state.fn == TrainerFn.FITTING
        run = self.broadcast(events.run_id())  # the group's ranks agree on rank 0's (Lightning's launcher sets none)
        # The event log is the run's: under default_root_dir when a launcher gave the run an id (its restarts read
        # the run's end there); a fit no launcher started writes one only where LIGHTNING_FT_EVENTS_DIR asks.
        log_root = trainer.default_root_dir if events.given_run_id() else None
        events.configure(self.settings.replica_group_id, self.global_rank, log_root, run)
        if fitting:  # before this group registers with the lighthouse
            self._lifecycle = GroupLifecycle(trainer, self.settings, self.global_rank, self.broadcast, run)
            self._lifecycle.exit_if_job_finished(trainer)
        self._sigterm_deadline.install()  # before Lightning's own SIGTERM handler, which then calls this one too
        self._handle = build_manager(
            self.settings, self.global_rank, self.world_size, self.root_device, num_nodes=self.num_nodes
        )
        self._telemetry = FTTelemetry(self._handle.manager, self._handle.transport, self.num_replica_groups)
        if fitting and self._lifecycle is not None:
            self._protocol = StepProtocol(self._handle.manager, self._telemetry, self._model_buffers())
            self._protocol.check_before_vote(self._lifecycle.last_step_check(trainer).before_vote)
            if not self.algorithm.semi_sync:
                self._step = StepOwner(
                    self._protocol,
                    skip_non_finite=self.settings.skip_non_finite_steps,
                    sharded=self.data_parallel.sharded,
                )
            add_default_callbacks(
                trainer,
                semi_sync=self.algorithm.semi_sync,
                exactly_once=self.data_mode == "exactly_once",
                several_groups=self.num_replica_groups > 1,
            )
            events.emit(
                "started",
                attempt=torchrun_restart_count(),
                ppid=os.getppid(),
                replica_groups=self.num_replica_groups,
                run=run,
            )
            self._lifecycle.start_where_the_job_is(trainer, self._protocol, self._patches)
        self._collectives = CrossGroupCollectives(
            self._handle.manager,
            self._protocol,
            self._section_position,
            expected_groups=self.num_replica_groups if self.settings.world_size_mode == "dynamic" else None,
        )
        if self._protocol is not None:
            own = strategy_contract(
                self.settings, self.algorithm, self.data_parallel, self.data_mode, self._ddp_kwargs, self.world_size
            )
            install_contract_check(trainer, own, self._handle.manager, self.replica_group_id, self.num_replica_groups)

    def _model_buffers(self) -> ModelBuffers | None:
        """The model's buffers, averaged across the job at each vote, unless ``buffer_sync="off"``."""
        if self.settings.buffer_sync == "off":
            return None
        assert self._handle is not None
        return ModelBuffers(
            self._module,
            self._handle.manager,
            group_size=self.world_size,
            restore_on_reject=not self.algorithm.semi_sync,
            at_batch_end=not self.algorithm.semi_sync and not self._module.automatic_optimization,
        )

    @override
    def _configure_launcher(self) -> None:
        """A group of one process has nothing to launch; Lightning's launcher would still start a process observer
        that watches no process and outlives the fit (a thread per fit)."""
        if self.num_processes == 1 and self.num_nodes == 1:
            self._launcher = None
            return
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        """A one-process group's store binds a free port itself: a ``MASTER_PORT`` chosen by torchrun or Lightning
        may be taken before this process, after its imports, binds it (EADDRINUSE, a wasted restart)."""
        if self.world_size == 1:
            os.environ["MASTER_PORT"] = "0"
        with loop_patches.without_process_group_banner():
            super().setup_distributed()

    def _section_position(self) -> tuple[int, int, int]:
        """Where this group is when it enters a sync section: committed step, epoch, batches read in this fit."""
        trainer = self._module.trainer
        step = self._handle.manager.current_step() if self._handle is not None else 0
        if self._protocol is None:
            return step, 0, 0
        return step, trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.total.ready

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up the model and optimizers as ``DDPStrategy`` does (with FSDP2 sharding in place of the DDP wrapper
        for ``data_parallel="fsdp"``); while fitting, refuse what cannot work and make Lightning's loops count
        committed steps; reductions may cross groups from here on.

        Raises:
            FTConfigError: Per-step training with an optimizer whose step evaluates the closure a loss-dependent
                number of times (LBFGS); ``val_check_interval`` as a duration in a job of several groups;
                ``data_mode="exactly_once"`` with ``accumulate_grad_batches`` other than 1.
            UnsupportedModelError: With FSDP, parameters that FSDP2 does not manage after sharding.
        """
        self._in_group.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            check_optimizers(self.optimizers, semi_sync=self.algorithm.semi_sync)
            refuse_group_local_settings(trainer, self.num_replica_groups)
            if self.algorithm.semi_sync:  # LR schedulers follow inner steps, which always happen
                warn_unsynced_tail(self.algorithm, trainer.max_steps)
            else:
                loop_patches.settle_each_step(self._patches, trainer, self.step_owner)
            if self.num_replica_groups > 1:
                loop_patches.name_checkpoints_alike(self._patches, trainer)
            elif self._lifecycle is not None and self._lifecycle.record.exists:
                loop_patches.version_against_other_runs(self._patches, trainer, self._lifecycle.record.wrote)
            loop_patches.summarize_the_model_once(self._patches, trainer)
            if self.data_mode == "exactly_once":
                self._exactly_once.prepare(trainer, self._patches)
        if self._collectives is not None:
            loop_patches.keep_dataloader_checks_group_local(self._patches, trainer, self._collectives)
            loop_patches.sync_metrics_across_groups(self._patches, self._module, self._collectives.all_gather)

    def _fsdp_cross_group_hook(self) -> Callable[..., Any]:
        """FSDP2's all-reduce hook: each reduced gradient shard averaged across groups, in the step's quorum."""
        return fsdp_cross_group_hook(self.manager, before_allreduce=self.step_protocol.before_cross_group_allreduce)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:  # or the model as it is
        """torch's DDP refuses a model none of whose parameters requires a gradient (a model frozen at the start):
        it then stays unwrapped, with nothing to average, as on Lightning's single device."""
        if not any(parameter.requires_grad for parameter in model.parameters()):
            self._frozen_at_start = True
            return model  # type: ignore[return-value]
        self._frozen_at_start = False
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            return  # frozen at the start: no gradient to average
        if self.algorithm.semi_sync:
            return  # inner steps: DDP's own allreduce inside the group, nothing crosses groups between syncs
        self._comm_state = install_ddp_cross_group_hook(
            self.model, self.manager, self.step_protocol, self.world_size, self.settings.num_replica_groups > 1
        )

    # ------------------------------------------------------------------ job-wide reductions
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over every participating replica, where every group makes the same collectives (an optimizer
        step, validation and test, an epoch end); elsewhere, and with an explicit ``group``, inside the group.

        Returns:
            The reduced tensor (``tensor`` itself, reduced in place, when the dtype allows, as DDP's); anything
            that is not a tensor as ``DDPStrategy.reduce`` returns it.

        Raises:
            UnsupportedArgumentError: Across groups, a ``reduce_op`` other than sum, mean (avg), max, min and
                product.
        """
        if not isinstance(tensor, Tensor) or group is not None or self._collectives is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return self._collectives.reduce(tensor, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``EarlyStopping`` and ``ModelCheckpoint`` reach the same decision in every replica group.

        Returns:
            Whether ``decision`` holds in every participating process (in any of them with ``all=False``).
        """
        if self._collectives is None:
            return super().reduce_boolean_decision(decision, all=all)
        return self._collectives.decide(decision, require_all=all)

    @override
    def on_validation_start(self) -> None:
        """Open a sync section: every group validates at the same committed step, so validation's reductions may
        cross groups (not during the sanity check, which a restarted group runs while its peers train)."""
        self._open_sync_section()

    @override
    def on_test_start(self) -> None:
        """Open a sync section, as :meth:`on_validation_start` does, for testing."""
        self._open_sync_section()

    def _open_sync_section(self) -> None:
        """Every group validates (tests) at the same committed step: its reductions may cross groups. Not during
        the sanity check, which a restarted group runs while its peers train."""
        if self._collectives is not None and not self._module.trainer.sanity_checking:
            self._collectives.open_section()

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``training_step`` as ``DDPStrategy`` does; the step owner reads its loss.

        Returns:
            What the LightningModule's ``training_step`` returned.
        """
        if self._torch_note_pending:
            self._torch_note_pending = False
            with first_forward_without_torch_note():
                output = super().training_step(*args, **kwargs)
        else:
            output = super().training_step(*args, **kwargs)
        if self._step is not None:
            self._step.saw_output(output)
        return output

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Semi-synchronously an inner step, group-local and always taken (the syncs commit or not); while fitting
        otherwise, the step owner's: the closure runs, the groups vote, the optimizer steps only on a commit.

        Returns:
            What the precision plugin's ``optimizer_step`` returned (the closure's output).

        Raises:
            FTConfigError: A model frozen when the fit started (left without the DDP wrapper) now has a gradient, in
                a job of several processes.
        """
        if self._frozen_at_start and self.job_shard.world_size > 1:
            check_nothing_unfrozen(self._module)
        if self.algorithm.semi_sync or self._step is None:  # outside a fit, a step is the group's own, as in DDP
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self._module
        assert isinstance(model, pl.LightningModule)  # as Lightning's Strategy.optimizer_step asserts
        return self.step_owner.step(optimizer, closure, model, self.precision_plugin, self._comm_state, **kwargs)

    # ------------------------------------------------------------------ inside the group: DDP or FSDP2
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient sync inside the group while accumulating (DDP's ``no_sync``, or FSDP2's equivalent)."""
        with self._in_group.block_backward_sync(self):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint (with FSDP, the full state, gathered for group rank 0); for a heal
        (:attr:`heal_mode` open), this process's own state.

        Returns:
            The model's state dict.
        """
        if self.heal_mode.is_open:
            return self.heal_mode.model_state(DDPStrategy.lightning_module_state_dict(self))
        return self._in_group.lightning_module_state_dict(self)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """An optimizer's state for a checkpoint (with FSDP, the full state keyed by parameter name); for a heal,
        this process's own.

        Returns:
            The optimizer's state dict.
        """
        if self.heal_mode.is_open:
            return self.heal_mode.optimizer_state(DDPStrategy.optimizer_state(self, optimizer))
        return self._in_group.optimizer_state(self, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the model's state from a checkpoint (with FSDP, a full state into the shards); for a heal, this
        process's own state (with FSDP, the shards already wrapped back by the heal's check)."""
        if self.heal_mode.is_open:
            DDPStrategy.load_model_state_dict(self, checkpoint, strict=strict)
        else:
            self._in_group.load_model_state_dict(self, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizers' state from a checkpoint (with FSDP, a full state into the shards); for a heal, this
        process's own state."""
        if self.heal_mode.is_open:
            DDPStrategy.load_optimizer_state_dict(self, checkpoint)
        else:
            self._in_group.load_optimizer_state_dict(self, checkpoint)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: lightning.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write only on the single checkpoint writer, crash-safely, and only forward (not a state older than the
        newest in the file's directory); every rank also writes its own data position beside it."""
        step = int(checkpoint.get("global_step", 0))
        if self._lifecycle is not None and self._lifecycle.refuses_save(filepath, step, self.is_checkpoint_writer):
            return
        save_own_position(
            checkpoint, filepath, self.replica_group_id, self.global_rank, is_writer=self.is_checkpoint_writer
        )
        if self.is_checkpoint_writer:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if self._lifecycle is not None:
                self._lifecycle.record.record_save(filepath, step)
            events.emit("checkpoint_saved", path=str(filepath), step=checkpoint.get("global_step"))

    @override
    def remove_checkpoint(self, filepath: lightning.PathLike) -> None:
        """On the checkpoint writer only: remove the checkpoint, its data-position sidecars and its entry in the job's
        record."""
        if self.is_checkpoint_writer:
            self.checkpoint_io.remove_checkpoint(filepath)
            remove_sidecars(filepath)
            if self._lifecycle is not None:
                self._lifecycle.record.record_removal(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: lightning.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the shared checkpoint (``weights_only=True`` unless asked otherwise: the files hold plain data),
        then give it this rank's own data position from its sidecar.

        Returns:
            The checkpoint, with this rank's own data position.

        Raises:
            UnreadableCheckpointError: The file is corrupt or truncated, holds an object that a ``weights_only``
                load refuses, or is not a Lightning checkpoint (``lightning_ft.checkpoint_io``).
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
        """Record the job's end; the ``finished`` event, with a fingerprint of the final state when the event log
        was asked for explicitly (the fault tests; never by default: with FSDP it gathers the whole state)."""
        trainer = self._module.trainer
        if self._lifecycle is not None and self._protocol is not None:
            self._lifecycle.record_the_end(trainer, self.manager.current_step())
        if events.enabled():
            fingerprint = {"fingerprint": state_fingerprint(trainer)} if events.requested() else {}
            events.emit("finished", step=self.manager.current_step(), global_step=trainer.global_step, **fingerprint)

    @override
    def teardown(self) -> None:
        """As ``DDPStrategy``'s; then restore the job-shard environment variables, undo the loop patches and the
        SIGTERM handler, and shut this group's Manager down (its servers and lighthouse connection)."""
        super().teardown()
        if self._environment_before is not None:
            forget_job_shard(self._environment_before)
            self._environment_before = None
        self._sigterm_deadline.uninstall()
        self._patches.undo()
        self._collectives = None
        self._comm_state = None
        self._exactly_once = ExactlyOnceTraining()
        if self._handle is not None:
            self._handle.shutdown()
            self._handle = None
            self._protocol = None
            self._step = None
            self._telemetry = None


# FTStrategy's own argument names: the suggestions for a misspelled one (lightning_ft.configuration).
_OWN_ARGUMENTS = tuple(
    name for name in inspect.signature(FTStrategy.__init__).parameters if name not in ("self", "kwargs")
)

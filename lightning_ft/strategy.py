"""FTStrategy: Lightning data parallelism inside a replica group, torchft fault tolerance across groups.

Topology
--------
A job is N *replica groups*. Each group is an ordinary Lightning DDP world of 1..K processes (one ``torchrun`` job,
Lightning's own launcher, or a plain ``python`` process) whose torch default process group never leaves the group:
Lightning broadcasts on it every batch, so a dead peer on it would hang everyone. One torchft ``Manager`` per group
connects the groups: it forms a quorum of live groups each step, averages gradients between them, votes on whether
the step commits, and streams the whole training state to a group that is behind (a restarted or late one).

One optimizer step
------------------
1. ``QuorumCallback.on_train_batch_start`` opens the step's quorum (once per accumulation window). With synchronous
   quorum, a group that is behind heals here, before its forward pass.
2. Forward and backward run as usual. DDP reduces gradients inside the group; its comm hook
   (:func:`~lightning_ft.step.gradient_hooks.ft_allreduce_hook`) then averages them across groups through the Manager. With
   ``data_parallel="fsdp"`` (HSDP, :mod:`lightning_ft.hsdp`), FSDP2 reduce-scatters inside the group instead and its
   all-reduce hook (:func:`~lightning_ft.step.gradient_hooks.fsdp_cross_group_hook`) averages each rank's shard across groups.
3. :meth:`FTStrategy.optimizer_step` hands the precision plugin a
   :class:`~lightning_ft.step.protocol.CommitGatedOptimizer`: clipping, ``on_before_optimizer_step`` and GradScaler run as
   usual, then the real optimizer steps only if ``should_commit()`` agrees. With asynchronous quorum, a group that is
   behind heals inside that vote and then applies the averaged gradient of its peers.
4. ``QuorumCallback.on_train_batch_end`` sets ``trainer.global_step`` to the Manager's committed step count, and
   step-interval LR schedulers only advance when the step committed.

Failure semantics
-----------------
* A peer group dying between steps: the survivors block in the next quorum until the lighthouse's heartbeat timeout
  declares it dead, then carry on with the remaining groups (``min_replica_size`` permitting).
* A peer group dying mid-allreduce: the survivors' step does not commit (parameters, optimizer state and learning
  rate stay exactly as they were) and the next step proceeds without the dead group.
* A process dying inside a group: the group's own collectives fail and the whole group exits; its launcher
  (``torchrun --max-restarts``) restarts it and it heals from a live peer. The group is the unit of failure.
* The lighthouse going away: every group stalls at its next quorum with one warning, and resumes at the same step
  once a lighthouse is back at the same address (``lighthouse_outage_timeout``, :mod:`lightning_ft.manager.lighthouse_outage`).
* Never committed twice, never silently different: a healed group holds its peer's exact bytes.

One job, one writer
-------------------
Ranks stay group-local, but two job-wide duties have a single owner: global checkpoints are written by rank 0 of the
lowest-numbered group in the current quorum (:attr:`FTStrategy.is_checkpoint_writer`, which moves on when that group
dies), and Lightning's rank-zero rule (loggers, rank-zero messages) applies to rank 0 of group 0 only.

What fault tolerance did
------------------------
Each group measures its own quorum waits, heals and votes (:mod:`lightning_ft.manager.telemetry`, no cross-group traffic);
:class:`~lightning_ft.callbacks.FaultToleranceMonitor` logs them as ``ft/`` metrics and shows ``replicas P/N`` in the
progress bar, and every process writes an event log under ``default_root_dir/ft_events``
(:mod:`lightning_ft_job.events`) that ``lightning-ft report`` draws. See ``docs/observability.md``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _sync_module_states
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
from torchft import Manager
from typing_extensions import override

from lightning_ft.algorithms import AlgorithmSettings, OuterOptimizerFactory, resolve_algorithm
from lightning_ft.checkpoint_io import AtomicCheckpointIO, load_checked
from lightning_ft.data.placement import ExactlyOnceData, StepPlacement, exactly_once_loader, resolve_data_mode
from lightning_ft.data.sidecars import remove_sidecars, save_own_position, use_own_position
from lightning_ft.hsdp import checkpoint as sharded_checkpoint
from lightning_ft.hsdp.config import DataParallelSettings, resolve_data_parallel
from lightning_ft.hsdp.sharding import fsdp_modules, group_mesh, is_sharded, shard_module
from lightning_ft.manager import ManagerHandle, build_manager
from lightning_ft.manager.internals import crosses_groups_over_gloo
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.settings import FTConfigError, FTSettings, resolve_settings
from lightning_ft.signals import SigtermDeadline
from lightning_ft.start.decision import (
    JobAlreadyFinished,
    NoLivePeerError,
    StartContext,
    StartDecision,
    already_finished_message,
    decide_start,
    finished_job,
)
from lightning_ft.start.record import JobRecord, durable_checkpoint_dirs
from lightning_ft.state import state_fingerprint
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.gradient_hooks import FTCommState, fsdp_cross_group_hook, ft_allreduce_hook
from lightning_ft.step.left_behind import LeftBehindWatch
from lightning_ft.step.protocol import CommitGatedOptimizer, StepProtocol
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")


class FTStrategy(DDPStrategy):
    """Fault-tolerant data parallelism across replica groups with torchft.

    Use it like ``DDPStrategy``: ``Trainer(strategy=FTStrategy())``, ``Trainer(strategy="ft")``, or
    ``class_path: lightning_ft.FTStrategy`` in LightningCLI YAML. Start each replica group with the same script;
    ``lightning-ft launch`` does that for you on one machine.

    Args:
        replica_group_id: This group's id in ``[0, num_replica_groups)``. Default: env ``REPLICA_GROUP_ID``, else 0.
        num_replica_groups: The most groups the job will have; data is sharded over this many groups times the group
            size. Default: env ``NUM_REPLICA_GROUPS``, else 1.
        lighthouse: URL of the torchft lighthouse shared by all groups. Default: env ``TORCHFT_LIGHTHOUSE``; with
            neither and a single group, one is started in this process.
        min_replica_size: A step commits only if at least this many groups took part in it.
        use_async_quorum: Compute the quorum during the forward pass (faster). A group that is behind then sits out
            one step and heals inside the commit vote. With ``False`` it heals before its forward pass. Default:
            ``True`` for ``algorithm="ddp"``, ``False`` for the semi-synchronous algorithms (DiLoCo refuses ``True``)
            and for ``data_parallel="fsdp"`` (which refuses ``True``).
        timeout: Seconds for cross-group collectives, the commit vote and state transfer.
        quorum_timeout: Seconds to wait for a quorum; must exceed the time between two steps.
        connect_timeout: Seconds to connect to the lighthouse and the group's ManagerServer. A connection either
            opens within seconds or the address is wrong, so the default (20, torchft's is 60) reports a wrong
            lighthouse URL well within a minute.
        start_timeout: Seconds the job's first committed step waits for every one of ``num_replica_groups`` groups
            to start (groups of one job may start seconds or minutes apart). When it expires, the job starts with the
            groups present (as ``min_replica_size`` allows) and warns once, naming the missing groups; they join and
            heal later. ``0`` starts as soon as any group is up. A group that joins a job already under way never
            waits. Default: env ``LIGHTNING_FT_START_TIMEOUT``, else 300. It also bounds how long a restarted group
            waits for a live peer when the job keeps no checkpoint (see ``docs/failure-semantics.md``).
        lighthouse_outage_timeout: Seconds a lighthouse outage may last. While the lighthouse is unreachable every
            group stalls at its next quorum (one warning naming the lighthouse), asks again once a lighthouse is back
            at the same address, and resumes without losing or re-applying a step; after this long it fails with
            ``LighthouseUnavailableError``. Default 600: a supervisor restarts a lighthouse within seconds, and a
            Kubernetes node failure reschedules its pods after about 5 minutes; past that, idle accelerators cost
            more than a restart from the last checkpoint. ``None`` waits for as long as it takes. Only applies to an
            external lighthouse (``lighthouse``/``TORCHFT_LIGHTHOUSE``); an embedded one dies with its process.
        init_sync: Heal every group from one peer at step 0, so groups may start from different random weights.
            Set ``False`` only if every group initialises identically.
        max_retries: Stop with an error after this many consecutive uncommitted steps. ``None`` retries forever.
        process_group: Backend between groups: ``"gloo"``, ``"nccl"``, or ``"auto"`` (NCCL on CUDA, else Gloo).
        checkpoint_transport: How a healing group receives state: ``"http"`` or ``"pg"`` (the cross-group
            process group).
        hostname: Address this group advertises to other groups for healing, its store and its ManagerServer.
            Default: env ``LIGHTNING_FT_HOSTNAME``; else loopback for one node with the embedded lighthouse; else the
            machine's hostname. A loopback address also binds those listeners to loopback (``docs/security.md``).
        interface: Advertise this network interface's IPv4 address instead of a name (for example the fast network's
            ``ib0`` or ``eth1``; torchft issue 329 reports a 40× slower heal over the wrong one). Default: env
            ``LIGHTNING_FT_INTERFACE``. Give either ``hostname`` or ``interface``.
        replica_id_prefix: Prefix of the id registered with the lighthouse; the group id is appended.
        skip_non_finite_steps: When a step's averaged gradient has an inf or NaN, every replica skips the step (it does
            not commit; the batch is not retried) instead of writing NaN into every replica's weights. Counted and
            logged. One bad batch on one replica poisons the average, so without this every replica would diverge.
        world_size_mode: How many groups contribute to a step. ``"dynamic"``: every group in the quorum, and the
            gradient is averaged over however many there are (the effective batch follows the membership).
            ``"fixed_with_spares"`` (torchft's ``WorldSizeMode.FIXED_WITH_SPARES``): exactly ``min_replica_size``
            groups contribute; any others are hot spares that apply every committed step (so they stay healed) but
            contribute zero, and one takes a dead group's place at the next quorum, without a heal. The effective
            batch then stays ``min_replica_size`` groups' worth. See ``docs/elasticity.md``.
        data_mode: Which samples each group reads. ``"sharded"``: each group reads its own fixed shard (torchft's
            sampler does the same); a dead group's shard is skipped until it is back, and a healed group goes on in
            its own shard from its peer's batch index. ``"exactly_once"``: each committed step reads the next
            ``participants × group size × batch_size`` samples of one permutation per epoch, so no sample of an
            epoch is skipped or read twice whoever dies or joins (:mod:`lightning_ft.data.placement`). It needs
            synchronous quorum (the default in that mode), ``algorithm="ddp"``, a map-style dataset and
            ``accumulate_grad_batches=1``. See ``docs/elasticity.md``.
        algorithm: How groups synchronise: ``"ddp"`` (gradients every step), ``"local_sgd"`` (parameters every
            ``sync_every`` inner steps) or ``"diloco"`` (pseudo-gradients and an outer optimizer every ``sync_every``
            inner steps). See ``docs/semi-sync.md``.
        sync_every: Inner optimizer steps between two syncs; required by ``local_sgd`` and ``diloco`` only.
        outer_optimizer: DiLoCo only: ``{"class_path": ..., "init_args": {...}}`` or a callable
            ``params -> Optimizer``. Default: Nesterov SGD, lr 0.7, momentum 0.9.
        fragments: DiLoCo only: a number ``k`` (automatic split into ``k`` fragments) or lists of module names, one
            list per fragment, for streaming DiLoCo. Default: 1 (the whole model syncs at once).
        fragment_sync_delay: DiLoCo only: inner steps a fragment's allreduce may overlap (below
            ``sync_every / fragments``). Default 0.
        fragment_update_alpha: DiLoCo only: in [0, 1]; 0 takes the new global parameters, 1 keeps the local ones.
        quantize: DiLoCo only: quantise pseudo-gradients for the allreduce. Needs CUDA and Triton.
        data_parallel: How a group is data parallel inside itself: ``"ddp"`` (every rank holds a full replica) or
            ``"fsdp"`` (FSDP2 shards the model inside the group; gradients are reduce-scattered in the group and the
            shards averaged across groups; HSDP, see ``docs/hsdp.md``). ``"fsdp"`` defaults to synchronous quorum.
        fsdp_wrap: FSDP only, when ``configure_model`` does not call ``fully_shard``: module classes that get their
            own ``fully_shard``, by class name (``"TransformerBlock"``) or import path (``"torch.nn.Linear"``).
        fsdp_min_params: FSDP only: also shard every module with at least this many parameters of its own.
        fsdp_mixed_precision: FSDP only: FSDP2's ``MixedPrecisionPolicy`` fields, dtypes by name, e.g.
            ``{"param_dtype": "bfloat16", "reduce_dtype": "float32"}``.
        fsdp_cpu_offload: FSDP only: keep sharded parameters, gradients and optimizer state in CPU memory.
        fsdp_reshard_after_forward: FSDP only: FSDP2's ``reshard_after_forward`` (default: true for inner modules,
            false for the root).
        gradient_as_bucket_view: DDP only: torch DDP's ``gradient_as_bucket_view``, on by default (DDP's default is
            off). Gradients are views into DDP's communication buckets, so no copy goes into a bucket before the
            allreduce and none back after it: two passes over the gradient per step fewer, about 5 % of a
            50M-parameter step on CPU (docs/benchmarks.md), and one gradient-sized buffer less. DDP treats missing
            and unused gradients as with copies. Set ``False`` for code that replaces ``param.grad`` tensors
            (DDP then refuses the step) or detaches them in place.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` and on to torch's
            ``DistributedDataParallel`` (``find_unused_parameters`` is always ``True``, see ``_setup_model``).
            With ``data_parallel="fsdp"`` only ``start_method`` is accepted.
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
        process_group: str = "auto",
        checkpoint_transport: str = "http",
        hostname: str | None = None,
        interface: str | None = None,
        replica_id_prefix: str = "lightning_ft_",
        skip_non_finite_steps: bool = True,
        lighthouse_outage_timeout: float | None = 600.0,
        start_timeout: float | None = None,
        world_size_mode: str = "dynamic",
        data_mode: str = "sharded",
        algorithm: str = "ddp",
        sync_every: int | None = None,
        outer_optimizer: OuterOptimizerFactory | dict[str, Any] | None = None,
        fragments: int | list[list[str]] | None = None,
        fragment_sync_delay: int | None = None,
        fragment_update_alpha: float | None = None,
        quantize: bool = False,
        data_parallel: str = "ddp",
        fsdp_wrap: list[str] | None = None,
        fsdp_min_params: int | None = None,
        fsdp_mixed_precision: dict[str, Any] | None = None,
        fsdp_cpu_offload: bool = False,
        fsdp_reshard_after_forward: bool | None = None,
        gradient_as_bucket_view: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.data_mode: str = data_mode
        use_async_quorum = resolve_data_mode(data_mode, algorithm, use_async_quorum)
        self.data_parallel: DataParallelSettings = resolve_data_parallel(
            data_parallel=data_parallel,
            algorithm=algorithm,
            use_async_quorum=use_async_quorum,
            fsdp_wrap=fsdp_wrap,
            fsdp_min_params=fsdp_min_params,
            fsdp_mixed_precision=fsdp_mixed_precision,
            fsdp_cpu_offload=fsdp_cpu_offload,
            fsdp_reshard_after_forward=fsdp_reshard_after_forward,
            ddp_kwargs=dict(kwargs),  # a copy: LightningCLI's signature reader gives up on `name=kwargs`
        )
        # Read here, not in a helper: LightningCLI's signature reader takes this default (True) as the setting's.
        find_unused_parameters = kwargs.get("find_unused_parameters", True)
        if self.data_parallel.sharded:
            # FSDP2 reshards parameters in the forward pass; an asynchronous quorum would read them meanwhile.
            use_async_quorum = False
        else:
            self._check_ddp_kwargs(find_unused_parameters, kwargs)
            kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        kwargs["find_unused_parameters"] = True  # (unused with FSDP, where no DDP wrapper exists)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self.algorithm: AlgorithmSettings = resolve_algorithm(
            algorithm=algorithm,
            use_async_quorum=use_async_quorum,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            quantize=quantize,
        )
        self.settings: FTSettings = resolve_settings(
            replica_group_id=replica_group_id,
            num_replica_groups=num_replica_groups,
            lighthouse=lighthouse,
            min_replica_size=min_replica_size,
            use_async_quorum=self.algorithm.use_async_quorum,
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
            lighthouse_outage_timeout=lighthouse_outage_timeout,
            world_size_mode=world_size_mode,
            start_timeout=start_timeout,
        )
        self._handle: ManagerHandle | None = None
        self._protocol: StepProtocol | None = None
        self._telemetry: FTTelemetry | None = None
        self._collectives: CrossGroupCollectives | None = None
        self._patches: list[tuple[object, str]] = []
        self._sigterm_deadline = SigtermDeadline()
        self._device_mesh: DeviceMesh | None = None
        self._comm_state: FTCommState | None = None
        self._exactly_once: ExactlyOnceData | None = None
        self._preparing_train_data = False
        self._job_record = JobRecord([])
        self._refused_a_save = False

    @staticmethod
    def _check_ddp_kwargs(find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
        # find_unused_parameters=True also stops DDP from rebuilding its gradient buckets after a group's first
        # step, so bucket i holds the same parameters in every group; a restarted group's first step would otherwise
        # allreduce a different layout against its peers. torchft's own DDP wrapper forces it for the same reason.
        if find_unused_parameters is not True:
            raise FTConfigError(
                "find_unused_parameters=False is not supported by FTStrategy: DDP would rebuild its gradient buckets "
                "after a group's first step, so a restarted group's buckets would not line up with its peers'. "
                "Remove the setting."
            )
        for unsupported in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(unsupported) is not None:
                raise FTConfigError(f"{unsupported}: FTStrategy installs its own cross-group comm hook; remove it.")

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Fault-tolerant data parallelism across replica groups (torchft)",
            override=True,
        )

    # ------------------------------------------------------------------ public surface
    @property
    def manager(self) -> Manager:
        """This group's torchft Manager (exists from ``setup_environment`` on, while fitting, validating, testing)."""
        if self._handle is None:
            raise RuntimeError(
                "FTStrategy.manager is only available while fitting, validating or testing, after setup_environment()."
            )
        return self._handle.manager

    @property
    def collectives(self) -> CrossGroupCollectives:
        """Job-wide reductions over every participating replica (see :mod:`lightning_ft.step.collectives`)."""
        if self._collectives is None:
            raise RuntimeError("FTStrategy.collectives is only available after setup_environment().")
        return self._collectives

    @property
    def step_protocol(self) -> StepProtocol:
        if self._protocol is None:
            raise RuntimeError("FTStrategy.step_protocol is only available while fitting, after setup_environment().")
        return self._protocol

    @property
    def telemetry(self) -> FTTelemetry:
        """This group's fault-tolerance figures (quorum waits, heals, votes; see :mod:`lightning_ft.manager.telemetry`)."""
        if self._telemetry is None:
            raise RuntimeError("FTStrategy.telemetry is only available while fitting, validating or testing.")
        return self._telemetry

    @property
    def exactly_once_data(self) -> ExactlyOnceData | None:
        """With ``data_mode="exactly_once"`` while fitting: the schedule, the last step's placement, and
        the refetch count. ``None`` otherwise."""
        return self._exactly_once

    @property
    def replica_group_id(self) -> int:
        return self.settings.replica_group_id

    @property
    def num_replica_groups(self) -> int:
        return self.settings.num_replica_groups

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this process writes the job's global checkpoints: rank 0 of the lowest-numbered group taking part
        in the current quorum. If that group dies, the next quorum hands the duty to the next group. A group that
        is healing does not take part, so it never writes. Outside fitting (no Manager), group 0's rank 0 writes.
        """
        if self.global_rank != 0:
            return False
        if self._handle is None or self._protocol is None:
            return self.settings.replica_group_id == 0
        return self._handle.manager.participating_rank() == 0

    def start_quorum(self) -> None:
        """Open the quorum for the current optimizer step (no-op if already open)."""
        self.step_protocol.open_quorum()

    @override
    def set_world_ranks(self) -> None:
        """Ranks stay group-local; Lightning's rank-zero rule becomes job-wide.

        Lightning lets only the process with ``rank_zero_only.rank == 0`` log to loggers and print rank-zero
        messages. With group-local ranks, every group's rank 0 would write to the same logger directory (and
        Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts). In the job-wide numbering
        (group id × group size + rank), that is rank 0 of group 0 only, as with global rank 0 in plain DDP.
        """
        super().set_world_ranks()
        job_rank = self.settings.replica_group_id * self.num_nodes * self.num_processes + self.global_rank
        rank_zero_only.rank = utilities_rank_zero_only.rank = job_rank

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data as one big world of ``num_replica_groups × group size`` ranks, ordered by group, then rank."""
        group_size = self.num_nodes * self.num_processes
        return {
            "num_replicas": self.settings.num_replica_groups * group_size,
            "rank": self.settings.replica_group_id * group_size + self.global_rank,
        }

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        super().setup_environment()
        if self.data_parallel.sharded:
            # Before configure_model(), which may shard the model itself over `self.device_mesh`.
            self._device_mesh = group_mesh(self.root_device)
            self.lightning_module._device_mesh = self._device_mesh
        if trainer.state.fn not in (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING):
            return
        events.configure(self.settings.replica_group_id, self.global_rank, trainer.default_root_dir)
        if trainer.state.fn == TrainerFn.FITTING:
            self._exit_if_job_finished(trainer)  # before this group registers with the lighthouse
        # Before Lightning registers its own SIGTERM handler, which then calls this one too.
        self._sigterm_deadline.install()
        self._handle = build_manager(
            self.settings, self.global_rank, self.world_size, self.root_device, num_nodes=self.num_nodes
        )
        self._telemetry = FTTelemetry(self._handle.manager, self._handle.transport, self.num_replica_groups)
        if trainer.state.fn == TrainerFn.FITTING:
            self._protocol = StepProtocol(self._handle.manager, self._telemetry)
            self._add_default_callbacks(trainer)
            events.emit(
                "started",
                attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                ppid=os.getppid(),
                replica_groups=self.num_replica_groups,
            )
            self._start_where_the_job_is(trainer)
        self._collectives = CrossGroupCollectives(self._handle.manager, self._protocol, self._section_position)

    def _section_position(self) -> tuple[int, int, int]:
        """Where this group is when it enters a sync section: committed step, epoch, batches read in this fit."""
        trainer = self.lightning_module.trainer
        step = self._handle.manager.current_step() if self._handle is not None else 0
        batches = trainer.fit_loop.epoch_loop.batch_progress.total.ready if self._protocol is not None else 0
        return step, trainer.current_epoch if self._protocol is not None else 0, batches

    # ------------------------------------------------------------------ one job, one model (lightning_ft.start.decision)
    def _exit_if_job_finished(self, trainer: pl.Trainer) -> None:
        """A group started after its job finished exits 0 at once: no training, logging or checkpoint."""
        self._job_record = JobRecord(durable_checkpoint_dirs(trainer))
        finished = None
        if self.global_rank == 0 and self._job_record.exists:
            finished = finished_job(self._job_record, trainer.max_steps, trainer.max_epochs)
        finished = self.broadcast(finished)
        if finished is not None:
            message = already_finished_message(finished, self.replica_group_id)
            log.warning(message)
            events.emit("job_already_finished", step=finished.step, directory=str(finished.directory))
            raise JobAlreadyFinished(finished)

    def _start_where_the_job_is(self, trainer: pl.Trainer) -> None:
        """Wait for a coherent start, then make sure this group never trains from a state older than the job's."""
        decision = None
        if self.global_rank == 0:
            decision = decide_start(
                StartContext(
                    group=self.replica_group_id,
                    num_groups=self.num_replica_groups,
                    prefix=self.settings.replica_id_prefix,
                    lighthouse=self.settings.lighthouse,
                    start_timeout_s=self.settings.start_timeout.total_seconds(),
                    attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                    record=self._job_record,
                )
            )
        decision = self.broadcast(decision)
        assert isinstance(decision, StartDecision)
        if decision.error is not None:
            events.emit("no_live_peer", error=decision.error)
            raise NoLivePeerError(decision.error)
        protocol = self.step_protocol
        connector = trainer._checkpoint_connector
        resume_start: Callable[..., None] = connector.resume_start

        def resume_where_the_job_is(checkpoint_path: _PATH | None = None, **kwargs: Any) -> None:
            if checkpoint_path:  # the user chose where the job resumes
                return resume_start(checkpoint_path, **kwargs)
            protocol.floor_step = decision.floor_step
            protocol.floor_source = decision.floor_source or protocol.floor_source
            if decision.resume_from is not None:
                log.warning(
                    "lightning-ft: no live replica group is ahead of the job's newest checkpoint; group %d resumes the "
                    "job from %s (committed step %d). Steps committed after it, if any, are lost.",
                    self.replica_group_id,
                    decision.resume_from,
                    decision.floor_step,
                )
                events.emit("resumed_from_checkpoint", path=str(decision.resume_from), step=decision.floor_step)
                checkpoint_path = decision.resume_from
            return resume_start(checkpoint_path, **kwargs)

        self._patch(connector, "resume_start", resume_where_the_job_is)

    def _add_default_callbacks(self, trainer: pl.Trainer) -> None:
        """Put the FT callbacks first unless the user supplied their own instance (or a subclass) of each."""
        from lightning_ft.callbacks import (
            DataPositionCallback,
            FaultToleranceMonitor,
            ManagerCheckpointCallback,
            QuorumCallback,
            StateTransferCallback,
            SyncCallback,
        )

        # DataPositionCallback first: it records each step's starting position before QuorumCallback opens the quorum
        # (SyncCallback, a sync's quorum). FaultToleranceMonitor after QuorumCallback: it reports the step's vote.
        from lightning_ft.callbacks.exactly_once import ExactlyOnceDataCallback

        opens_quorums = SyncCallback if self.algorithm.semi_sync else QuorumCallback
        defaults = [
            ExactlyOnceDataCallback if self.data_mode == "exactly_once" else DataPositionCallback,
            opens_quorums,
            StateTransferCallback,
            ManagerCheckpointCallback,
            FaultToleranceMonitor,
        ]
        missing = [cls() for cls in defaults if not any(isinstance(cb, cls) for cb in trainer.callbacks)]
        trainer.callbacks[0:0] = missing

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.data_parallel.sharded:
            self._setup_sharded(trainer)
        else:
            super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not self.algorithm.semi_sync:
            # Semi-synchronous: LR schedulers follow inner steps, which always happen.
            self._gate_step_lr_schedulers(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.algorithm.semi_sync:
            self._warn_unsynced_tail(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._name_checkpoints_alike_in_every_group(trainer)
            if self.data_mode == "exactly_once":
                self._prepare_exactly_once(trainer)
        if self._collectives is not None:
            self._keep_dataloader_checks_group_local(trainer)
            self._sync_metrics_across_groups()

    def _setup_sharded(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` with FSDP2 sharding in place of the DDP wrapper.

        The model is sharded only when fitting (as DDP only wraps then), unless ``configure_model`` sharded it. A model
        that is not sharded gets DDP's broadcast of rank 0's weights when not fitting; a sharded one must not (it
        would copy rank 0's shards over the others').
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self._shard_model()
            self.setup_optimizers(trainer)
        elif not is_sharded(self.model):
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self) -> None:
        """Shard the LightningModule inside the group and average each reduced shard across groups (HSDP)."""
        assert self.data_parallel.fsdp is not None and self._device_mesh is not None
        module = self.lightning_module
        shard_module(module, self._device_mesh, self.data_parallel.fsdp)
        hook = fsdp_cross_group_hook(self.manager, before_allreduce=self.step_protocol.require_quorum)
        for fsdp_module in fsdp_modules(module):
            fsdp_module.set_all_reduce_hook(hook)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The replica group's 1-D mesh (``data_parallel="fsdp"`` only), also ``LightningModule.device_mesh``."""
        if self._device_mesh is None:
            raise RuntimeError("FTStrategy.device_mesh exists with data_parallel='fsdp', after setup_environment().")
        return self._device_mesh

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches keep FSDP2's unsharded gradients local: no reduce-scatter, no cross-group
        average, until the last micro-batch reduces their sum (DDP's ``no_sync`` for FSDP2)."""
        if not self.data_parallel.sharded or self.model is None:
            with super().block_backward_sync():
                yield
            return
        modules = list(fsdp_modules(self.model))
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    @staticmethod
    def _name_checkpoints_alike_in_every_group(trainer: pl.Trainer) -> None:
        """Turn off ``ModelCheckpoint``'s version counter, which would name one checkpoint differently per group.

        Every group runs ``ModelCheckpoint``; only the writer writes. With the counter on, a group that checks for
        ``step=N.ckpt`` after the writer wrote it calls its own copy ``step=N-v1.ckpt``, so its callback state
        (best, last and top-k paths) names files that are never written, and a group that takes over writing
        would save under other names. Without it, a name is a function of the step and metrics only, the same
        everywhere; an existing file of that name is overwritten, as when a job resumes into its own directory.
        """
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback._enable_version_counter:
                callback._enable_version_counter = False
                log.info(
                    "lightning-ft: ModelCheckpoint(enable_version_counter=True) is turned off: every replica group "
                    "must give a checkpoint the same name."
                )

    def _warn_unsynced_tail(self, trainer: pl.Trainer) -> None:
        """The final sync happens only at a sync step: with ``max_steps`` not a multiple of ``sync_every``, the last
        inner steps stay local and the replicas end different."""
        period = self.algorithm.sync_period
        if trainer.max_steps > 0 and trainer.max_steps % period:
            log.warning(
                "lightning-ft: max_steps=%d is not a multiple of the sync period %d (sync_every / fragments); the "
                "last %d inner steps are not synchronised, so replica groups end with different parameters.",
                trainer.max_steps,
                period,
                trainer.max_steps % period,
            )

    # ------------------------------------------------------------------ exactly-once data
    def _prepare_exactly_once(self, trainer: pl.Trainer) -> None:
        """Mark the training dataloader's setup, so that :meth:`process_dataloader` rebuilds that loader only."""
        if trainer.accumulate_grad_batches != 1:
            raise FTConfigError(
                f"data_mode='exactly_once' with accumulate_grad_batches={trainer.accumulate_grad_batches}: a step's "
                "samples are known only once its quorum has formed, at its first micro-batch. Use "
                "accumulate_grad_batches=1 with a larger batch_size, or data_mode='sharded'."
            )
        fit_loop = trainer.fit_loop
        setup_data: Callable[[], None] = fit_loop.setup_data

        def setup_train_data() -> None:
            self._preparing_train_data = True
            try:
                setup_data()
            finally:
                self._preparing_train_data = False

        self._patch(fit_loop, "setup_data", setup_train_data)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With exactly-once data, the training loader reads the samples the committed state assigns (see
        :mod:`lightning_ft.data.placement`); other loaders are left alone."""
        if not self._preparing_train_data:
            return super().process_dataloader(dataloader)
        settings = self.settings
        spares = settings.world_size_mode == "fixed_with_spares"
        participants = settings.min_replica_size if spares else settings.num_replica_groups
        own_rank = settings.replica_group_id if settings.replica_group_id < participants else None
        loader, self._exactly_once = exactly_once_loader(
            dataloader,
            group_size=self.world_size,
            group_rank=self.global_rank,
            participants_guess=participants,
            rank_guess=own_rank,
            committed=self.manager.batches_committed,
        )
        return loader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """With exactly-once data, a training batch is where the step's (synchronous) quorum opens: a behind group
        heals here, then the batch is checked against the samples the quorum assigns and refetched if the loader's
        prediction was wrong."""
        data = self._exactly_once
        trainer = self.lightning_module.trainer
        if data is not None and trainer.training:
            self.step_protocol.open_quorum()
            manager = self.manager
            placement = StepPlacement(
                cursor=manager.batches_committed(),
                participants=manager.num_participants(),
                participating_rank=manager.participating_rank(),
            )
            batch, refetched = data.batch_for_step(batch, placement)
            if refetched:
                batch = trainer.precision_plugin.convert_input(batch)
                batch = self.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
                events.emit("data_refetched", step=manager.current_step(), cursor=placement.cursor)
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    def _patch(self, target: object, name: str, replacement: Callable[..., Any]) -> None:
        """Shadow a bound method with an instance attribute, undone at teardown (a trainer may fit again)."""
        setattr(target, name, replacement)
        self._patches.append((target, name))

    def _keep_dataloader_checks_group_local(self, trainer: pl.Trainer) -> None:
        """Lightning asks every rank whether its dataloader is empty once per process lifetime, through
        ``Strategy.reduce``. A restarted group asks when its peers do not, so that question stays inside the group."""
        loops = [trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop]
        collectives = self.collectives
        for loop in loops:
            setup_data: Callable[[], None] = loop.setup_data

            def group_local_setup_data(setup_data: Callable[[], None] = setup_data) -> None:
                with collectives.group_local():
                    setup_data()

            self._patch(loop, "setup_data", group_local_setup_data)

    def _sync_metrics_across_groups(self) -> None:
        """torchmetrics ``Metric`` objects of the module sync over every participating replica, not just the group.

        A metric's own ``dist_sync_fn`` or ``process_group``, when the user set one, is left alone.
        """
        from torchmetrics import Metric

        for module in self.lightning_module.modules():
            if isinstance(module, Metric) and module.dist_sync_fn is None and module.process_group is None:
                module.dist_sync_fn = self.collectives.all_gather
                self._patches.append((module, "dist_sync_fn"))

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        if self.algorithm.semi_sync:
            return  # inner steps: DDP's own allreduce inside the group, nothing crosses groups between syncs
        gloo = crosses_groups_over_gloo(self.manager)
        # With an external lighthouse there may be peers that go on without this group (lightning_ft.step.left_behind);
        # the embedded one serves a single group.
        lighthouse = self.settings.lighthouse
        left_behind = LeftBehindWatch(self.manager, lighthouse) if gloo and lighthouse else None
        self.step_protocol.left_behind = left_behind
        self._comm_state = FTCommState(
            manager=self.manager,
            group=None,
            group_world_size=self.world_size,
            before_allreduce=self.step_protocol.require_quorum,
            needs_manager_timeout=not gloo,
            left_behind=left_behind,
        )
        self.model.register_comm_hook(self._comm_state, ft_allreduce_hook)

    def _gate_step_lr_schedulers(self, trainer: pl.Trainer) -> None:
        """Step-interval LR schedulers advance only on a committed step.

        Lightning steps them after every optimizer step, committed or not. The gate sits on the epoch loop's own
        scheduler update, so the scheduler objects stay the user's own (``self.lr_schedulers()`` and
        checkpoints see the real thing).
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        update: Callable[[str, bool], None] = epoch_loop.update_lr_schedulers
        protocol = self.step_protocol

        def update_if_committed(interval: str, update_plateau_schedulers: bool) -> None:
            if interval == "step" and protocol.last_step_committed is False:
                return
            update(interval, update_plateau_schedulers)

        self._patch(epoch_loop, "update_lr_schedulers", update_if_committed)

    # ------------------------------------------------------------------ job-wide reductions
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over every participating replica: inside the group, then across groups through the Manager.

        Across groups only where every group makes the same collectives (an optimizer step, validation and test,
        an epoch end; see :mod:`lightning_ft.step.collectives`); elsewhere, and with an explicit ``group``, inside the
        group as in DDP.
        """
        if not isinstance(tensor, Tensor) or group is not None or self._collectives is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return self._collectives.reduce(tensor, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``EarlyStopping`` and ``ModelCheckpoint`` reach the same decision in every replica group."""
        if self._collectives is None:
            return super().reduce_boolean_decision(decision, all=all)
        return self._collectives.decide(decision, require_all=all)

    @override
    def on_validation_start(self) -> None:
        self._open_sync_section()

    @override
    def on_test_start(self) -> None:
        self._open_sync_section()

    def _open_sync_section(self) -> None:
        """Every group validates (tests) at the same committed step: its reductions may cross groups. Not during
        the sanity check, which a restarted group runs while its peers train."""
        if self._collectives is not None and not self.lightning_module.trainer.sanity_checking:
            self._collectives.open_section()

    # ------------------------------------------------------------------ the step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure through the precision plugin, then step only if the step commits.

        GradScaler may skip ``optimizer.step()`` when it finds inf/NaN gradients; the commit vote is still taken,
        because every rank of the group must take part in it exactly once per step. Gradients were averaged across
        groups before unscaling, so every replica skips alike.
        """
        if self.algorithm.semi_sync:  # an inner step: group-local, always taken; the syncs commit or not
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        protocol = self.step_protocol
        comm_state = self._comm_state
        gated = CommitGatedOptimizer(
            optimizer,
            protocol,
            skip_non_finite=self.settings.skip_non_finite_steps,
            gradient_check=comm_state.take_gradient_check if comm_state is not None else None,
        )
        try:
            output = self.precision_plugin.optimizer_step(
                gated,  # type: ignore[arg-type]
                model=model or self.lightning_module,
                closure=closure,
                **kwargs,
            )
        finally:
            if comm_state is not None:  # a step that never reached the gate (GradScaler skipped it) leaves a check
                comm_state.take_gradient_check()
        if not protocol.decided:
            protocol.commit()
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write only on the single checkpoint writer (see :attr:`is_checkpoint_writer`), crash-safely. Every rank
        also writes its own data position beside it (see :mod:`lightning_ft.data.sidecars`).

        Checkpoints only move forward: a state at a lower committed step than the newest one in the file's
        directory is not written (one warning says why; :mod:`lightning_ft.start.record`)."""
        step = int(checkpoint.get("global_step", 0))
        refusal = self._job_record.refuse_save(filepath, step) if self.global_rank == 0 else None
        if self.broadcast(refusal) is not None:
            if self.is_checkpoint_writer:  # the others would not have written it anyway
                if not self._refused_a_save:
                    self._refused_a_save = True
                    log.warning("lightning-ft: not writing %s: %s.", filepath, refusal)
                events.emit("checkpoint_refused", path=str(filepath), step=step)
            return
        save_own_position(checkpoint, filepath, self.replica_group_id, self.global_rank)
        if self.is_checkpoint_writer:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            self._job_record.record_save(filepath, step)
            events.emit("checkpoint_saved", path=str(filepath), step=checkpoint.get("global_step"))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """With FSDP, the full (unsharded) model state, gathered for group rank 0 (see ``hsdp/checkpoint.py``)."""
        if not self.data_parallel.sharded:
            return super().lightning_module_state_dict()
        return sharded_checkpoint.full_model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """With FSDP, the full optimizer state keyed by parameter name, gathered for group rank 0."""
        if not self.data_parallel.sharded:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return sharded_checkpoint.full_optimizer_state(self.lightning_module, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.data_parallel.sharded:
            return super().load_model_state_dict(checkpoint, strict=strict)
        sharded_checkpoint.load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.data_parallel.sharded:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            sharded_checkpoint.load_full_optimizer_state(self.lightning_module, optimizer, state)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_checkpoint_writer:
            self.checkpoint_io.remove_checkpoint(filepath)
            remove_sidecars(filepath)
            self._job_record.record_removal(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the shared checkpoint, then give it this rank's own data position: its ``StatefulDataLoader``
        state from the sidecar, or none (the group then counts its way to the restored batch).

        ``weights_only`` defaults to ``True`` (whatever torch's own default): lightning-ft's checkpoints hold plain
        data only, and a file with other objects is refused rather than unpickled. A file that cannot be read
        raises :class:`~lightning_ft.checkpoint_io.UnreadableCheckpointError`, naming it and what to do.
        """
        weights_only = True if weights_only is None else weights_only
        load = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        checkpoint = load_checked(checkpoint_path, load)
        use_own_position(checkpoint, checkpoint_path, self.replica_group_id, self.global_rank, weights_only)
        return checkpoint

    @override
    def on_train_end(self) -> None:
        """The ``finished`` event; with the event log asked for explicitly (the fault tests), a fingerprint of the final
        state too. Never by default: it reads the whole state (with FSDP, gathers it)."""
        trainer = self.lightning_module.trainer
        self._record_the_end(trainer)
        if events.enabled():
            fingerprint = {"fingerprint": state_fingerprint(trainer)} if events.requested() else {}
            events.emit("finished", step=self.manager.current_step(), global_step=trainer.global_step, **fingerprint)

    def _record_the_end(self, trainer: pl.Trainer) -> None:
        """A fit that ended normally ended the job: each group's rank 0 says so in the job's record, so that a group
        started after the end exits instead of training a new model (:mod:`lightning_ft.start.decision`)."""
        if self.global_rank != 0 or not self._job_record.exists or self._protocol is None:
            return
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            reason = f"max_steps={trainer.max_steps} reached"
        elif (
            trainer.max_epochs is not None and trainer.max_epochs != -1 and trainer.current_epoch >= trainer.max_epochs
        ):
            reason = f"max_epochs={trainer.max_epochs} reached"
        elif trainer.should_stop:
            reason = "stopped early"
        else:
            return
        self._job_record.mark_finished(
            step=self.manager.current_step(),
            epoch=trainer.current_epoch,
            max_steps=trainer.max_steps,
            max_epochs=trainer.max_epochs,
            reason=reason,
        )

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        super().teardown()
        self._sigterm_deadline.uninstall()
        for target, name in reversed(self._patches):
            if name == "dist_sync_fn":
                setattr(target, name, None)
            else:
                vars(target).pop(name, None)
        self._patches.clear()
        self._collectives = None
        if self._comm_state is not None and self._comm_state.left_behind is not None:
            self._comm_state.left_behind.shutdown()
        self._comm_state = None
        self._exactly_once = None
        if self._handle is not None:
            self._handle.shutdown()
            self._handle = None
            self._protocol = None
            self._telemetry = None

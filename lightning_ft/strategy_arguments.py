"""FTStrategy's arguments: each defined once, here, by its name, type and default in the constructor's signature and
its doc in this class's docstring.

Everything else reads them from here: :mod:`lightning_ft.configuration` resolves them by name (each concept's
resolver takes the ones its parameters name), LightningCLI and jsonargparse read the signature and this docstring
(``class_path: lightning_ft.FTStrategy``), ``make docs`` renders them, and ``docs/configuration.md``'s argument
table is generated from them (``docs/argument_table.py``). :class:`~lightning_ft.FTStrategy` adds the hooks.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import loop_patches
from lightning_ft.algorithms import OuterOptimizerFactory
from lightning_ft.checkpoint_io import AtomicCheckpointIO
from lightning_ft.configuration import resolve_configuration
from lightning_ft.data.exactly_once_training import ExactlyOnceTraining
from lightning_ft.heal.checkpoint_mode import HealCheckpointMode
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
from lightning_ft.start.lifecycle import GroupLifecycle
from lightning_ft.step.gradient_hooks import FTCommState


class FTStrategyArguments(DDPStrategy):
    """FTStrategy's constructor: the arguments below, resolved once into ``settings``, ``algorithm``,
    ``data_parallel`` and ``data_mode``, and the state that :class:`~lightning_ft.FTStrategy`'s hooks keep.

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

    Raises:
        FTConfigError: An argument has a value that cannot work, alone or with the others; the message names the
            argument and the fix.
    """

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
        own = {name: value for name, value in locals().items() if name in OWN_ARGUMENTS}
        configuration = resolve_configuration(own, ddp_kwargs=dict(kwargs))  # a copy: see OWN_ARGUMENTS
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
        # Until the first training forward pass: torch's note about the search FTStrategy chose is kept off the
        # terminal there (lightning_ft.step.unused_parameter_note); no later step pays for it.
        self._torch_note_pending = configuration.unused_search_by_default
        # Open while a heal builds or restores Lightning's checkpoint: the checkpoint methods then serve this
        # process's own state (lightning_ft.heal.state).
        self.heal_mode = HealCheckpointMode()
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


#: FTStrategy's own arguments, by name: the constructor hands them to :mod:`lightning_ft.configuration`, the rest
#: (``**kwargs``) go on to DDPStrategy as a copy (LightningCLI's signature reader gives up on a call that forwards
#: ``name=kwargs``); the suggestions for a misspelled one.
OWN_ARGUMENTS = tuple(
    name for name in inspect.signature(FTStrategyArguments.__init__).parameters if name not in ("self", "kwargs")
)

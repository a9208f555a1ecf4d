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
from torch.nn import Module

from lightning_ft import lightning_internals, loop_patches
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
from lightning_ft.step.left_out_parameters import search_for_unused_parameters


class FTStrategyArguments(DDPStrategy):
    """FTStrategy's constructor: the arguments below, resolved once into ``settings``, ``algorithm``,
    ``data_parallel`` and ``data_mode``, and the state that :class:`~lightning_ft.FTStrategy`'s hooks keep.

    Args:
        replica_group_id: This group's id, in ``[0, num_replica_groups)``. Default: ``0``. Environment:
            ``REPLICA_GROUP_ID``.
        num_replica_groups: The most groups the job will have. Data is sharded over this many groups × the group size.
            Default: ``1``. Environment: ``NUM_REPLICA_GROUPS``.
        lighthouse: URL of the lighthouse shared by every group, e.g. ``http://host:29510``. With neither set and one
            group, a lighthouse starts inside the process (on loopback). With more than one group it is required.
            Environment: ``TORCHFT_LIGHTHOUSE``.
        min_replica_size: A step commits only if at least this many groups took part. Must not exceed
            ``num_replica_groups``.
        use_async_quorum: Compute the quorum during the forward pass. A group that is behind then sits out one step
            and heals inside the commit vote. ``False``: it heals before its forward pass, and every step waits for
            the quorum first. Default: ``True`` (``False`` for ``local_sgd``/``diloco``, for ``data_parallel="fsdp"``
            and for ``data_mode="exactly_once"``, each of which refuses ``True``).
        timeout: Seconds for cross-group collectives, the commit vote and the state transfer. Environment:
            ``TORCHFT_TIMEOUT_SEC`` overrides it (torchft).
        quorum_timeout: Seconds to wait for a quorum. Must be longer than the time between two steps (including
            validation). Environment: ``TORCHFT_QUORUM_TIMEOUT_SEC`` overrides it (torchft).
        connect_timeout: Seconds to connect to the lighthouse and the group's Manager server. An unreachable
            lighthouse is reported after this long, with ``LighthouseUnreachableError`` naming the URL, the settings
            that chose it (``lighthouse``, ``TORCHFT_LIGHTHOUSE``) and how to start one. (torchft's default is 60.)
            Environment: ``TORCHFT_CONNECT_TIMEOUT_SEC`` overrides it (torchft).
        init_sync: Heal every group from one peer at step 0, so groups may start from different random weights. Set
            ``False`` only if every group initialises identically.
        max_retries: Stop with an error after this many consecutive uncommitted steps. ``None`` retries forever.
        process_group: Backend between groups: ``"gloo"``, ``"nccl"``, or ``"auto"`` (NCCL on CUDA, otherwise Gloo).
        checkpoint_transport: How a healing group receives state: ``"http"`` (each rank serves its state over HTTP) or
            ``"pg"`` (over the cross-group process group).
        hostname: The address (a name or an IP) other groups use to reach this group: its store, Manager server and
            HTTP checkpoint server advertise it. When chosen (argument or environment) or loopback, the cross-group
            Gloo process group also binds to it, unless ``GLOO_SOCKET_IFNAME`` is set, which Gloo then uses instead. A
            loopback address also binds the store, Manager server and checkpoint server to loopback
            (``docs/security.md``). Choose the address on the network that other groups should use; a name that maps
            to ``127.0.0.1`` (as in many containers) is unreachable from other machines. NCCL picks its own interface
            (``NCCL_SOCKET_IFNAME``). Default: the machine's hostname; ``127.0.0.1`` for one node with the embedded
            lighthouse. Environment: ``LIGHTNING_FT_HOSTNAME`` (``lightning-ft launch`` with a loopback lighthouse
            sets ``127.0.0.1``).
        interface: Advertise this network interface's IPv4 address (for example ``ib0``, ``eth1``) instead of a name;
            it then behaves exactly as a chosen ``hostname``. Give ``hostname`` or ``interface``, not both (an
            argument wins over the environment). An interface without an IPv4 address is refused at construction,
            naming the interfaces the machine has. Environment: ``LIGHTNING_FT_INTERFACE``.
        replica_id_prefix: Prefix of the id the group registers with the lighthouse; the group id is appended (torchft
            reads the trailing digits).
        skip_non_finite_steps: When a step's averaged gradient has an inf or NaN, every replica skips the step (it
            does not commit) instead of writing NaN into every replica. Counted and logged. Steps that GradScaler
            already skips are unaffected.
        buffer_sync: How the model's buffers (BatchNorm's running statistics, any ``register_buffer``) cross groups.
            ``"average"``: at every vote, each buffer's change since the job last agreed is averaged over every
            process of every participating group, so every replica holds bit-identical buffers at every committed
            step, and a step that does not commit leaves them where they were (DDP's ``broadcast_buffers``, job-wide;
            ``docs/your-code.md#buffers``). ``"off"``: each replica keeps its own.
        lighthouse_outage_timeout: Seconds a lighthouse outage may last. While an external lighthouse is unreachable,
            every group stalls at its next quorum (one warning naming the lighthouse), asks again once a lighthouse
            has been back at the same address for 11 s, and resumes without losing or re-applying a step. After this
            long without a quorum it fails with ``LighthouseUnavailableError``. ``None`` waits for as long as it
            takes. 600 covers a supervisor restart and a Kubernetes node failure (pods are rescheduled after about 5
            minutes).
        start_timeout: Seconds the job's first committed step waits for every one of ``num_replica_groups`` groups to
            start. When it expires, the job starts with the groups present (as ``min_replica_size`` allows), with one
            warning naming the missing groups; they join and heal later. ``0`` starts as soon as any group is up. A
            group joining a job already under way never waits. It also bounds how long a restarted group waits for a
            live peer when the job keeps no checkpoint directory
            (``docs/failure-semantics.md#where-a-group-starts-from``). Default: ``300``. Environment:
            ``LIGHTNING_FT_START_TIMEOUT``.
        world_size_mode: ``"dynamic"``: every group in the quorum contributes and the gradient is averaged over them.
            ``"fixed_with_spares"``: exactly ``min_replica_size`` groups contribute, the others are hot spares that
            stay healed, contribute zero, and take a dead group's place without a heal (``docs/elasticity.md``).
        data_mode: ``"sharded"``: each rank reads its own fixed shard; lossy while membership changes.
            ``"exactly_once"``: each committed step reads the next samples of one permutation per epoch, by
            participating rank; no sample of an epoch skipped or read twice. Needs a map-style dataset,
            ``DataLoader(batch_size=...)`` without a custom sampler, synchronous quorum (its default in this mode),
            ``algorithm="ddp"`` and ``accumulate_grad_batches=1`` (``docs/elasticity.md#data-two-modes``).
        algorithm: ``"ddp"``: gradients averaged across groups every step. ``"local_sgd"``: each group takes
            ``sync_every`` inner steps on its own, then parameters are averaged. ``"diloco"``: the same with
            pseudo-gradients and an outer optimizer. See ``docs/semi-sync.md``.
        sync_every: Inner optimizer steps between two syncs; required by ``local_sgd``/``diloco``, refused with
            ``ddp``.
        outer_optimizer: DiLoCo only: ``class_path``/``init_args`` in YAML, or a callable ``params -> Optimizer``.
            Default: Nesterov SGD, lr 0.7, momentum 0.9.
        fragments: DiLoCo only: ``k`` (automatic split) or lists of module names, one per fragment (streaming DiLoCo).
            ``sync_every`` must be a multiple of the count. Default: ``1``.
        fragment_sync_delay: DiLoCo only: inner steps a fragment's pseudo-gradient allreduce overlaps before its outer
            step (τ in the Streaming DiLoCo paper); below ``sync_every / fragments``. Default: ``0``.
        fragment_update_alpha: DiLoCo only, in [0, 1]: 0 takes the new global parameters, 1 keeps the local ones.
            Default: ``0.0``.
        quantize: DiLoCo only: quantised pseudo-gradient allreduce; needs CUDA and Triton (refused otherwise).
        data_parallel: How a group is data parallel inside itself: ``"ddp"`` (every rank holds a full replica) or
            ``"fsdp"`` (FSDP2 shards the model inside the group; the gradient shards are averaged across groups). With
            ``"fsdp"``, ``use_async_quorum`` defaults to ``False`` (``True`` is refused) and ``algorithm`` must be
            ``"ddp"``. See ``docs/hsdp.md``.
        fsdp_wrap: FSDP only, when ``configure_model`` does not call ``fully_shard``: module classes that get their
            own ``fully_shard``, by class name (``"TransformerBlock"``) or import path (``"torch.nn.Linear"``).
        fsdp_min_params: FSDP only: also shard every module with at least this many parameters of its own separately.
        fsdp_mixed_precision: FSDP only: FSDP2's ``MixedPrecisionPolicy`` fields by name, e.g. ``{param_dtype:
            bfloat16, reduce_dtype: float32}``.
        fsdp_cpu_offload: FSDP only: FSDP2's ``CPUOffloadPolicy`` (shards, gradients and optimizer state in CPU
            memory).
        fsdp_reshard_after_forward: FSDP only: FSDP2's ``reshard_after_forward``. Default: FSDP2's.
        gradient_as_bucket_view: DDP only: torch DDP's setting, on here (DDP's default is off). Gradients are views
            into DDP's communication buckets: no copy into a bucket before the allreduce and none back after it, about
            5 % of a 50M-parameter step on CPU (``docs/benchmarks.md``) and one gradient-sized buffer less. Set
            ``False`` for code that replaces ``param.grad`` tensors or detaches them in place, which DDP refuses with
            views.
        find_unused_parameters: DDP only: torch DDP's setting. ``None``: chosen per model, ``False`` where the
            gradients make one bucket, ``True`` otherwise and with LocalSGD or DiLoCo (``docs/configuration.md`` says
            why); where it chose the search, torch's note that it found nothing is kept off the terminal (one line of
            FTStrategy's says why instead). An explicit value wins, and keeps torch's note. Either way a step may leave
            parameters out: each group gives them the average of the groups that used them, zeros where none did.
        accelerator: As ``DDPStrategy``'s (Lightning sets it from the Trainer's ``accelerator``).
        parallel_devices: As ``DDPStrategy``'s: this group's devices (Lightning sets them from ``devices``).
        cluster_environment: As ``DDPStrategy``'s: how this group's processes find each other (torchrun, SLURM, ...).
        checkpoint_io: As ``DDPStrategy``'s. Default: crash-safe local writes (temporary file, fsync, rename).
        precision_plugin: As ``DDPStrategy``'s (Lightning sets it from ``precision``).
        process_group_backend: As ``DDPStrategy``'s: the backend inside the group (cross-group: ``process_group``).
        **kwargs: Passed on to ``DDPStrategy`` and torch's ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``,
            25 unless set: torch's size, for the first bucket too, where torch's own default caps it at 1 MiB; each
            bucket crosses groups as one collective per step, so a model under 25 MiB makes one). A
            name that neither they nor FTStrategy accepts fails at construction, before anything starts, with an
            ``FTConfigError`` naming the nearest valid names (``replica_groups`` → ``num_replica_groups``; FSDP2's
            ``mp_policy`` → ``fsdp_mixed_precision``). With ``data_parallel="fsdp"`` only ``start_method`` (DDP
            settings left at their defaults are ignored, as LightningCLI passes them all).

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
        self._unused_search_by_default = configuration.unused_search_by_default
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

    def _choose_unused_search(self, model: Module) -> Module:
        """Resolve ``find_unused_parameters`` for ``model`` before DDP wraps it; returns ``model``. The default
        (``None``) searches only where the search buys overlap (:mod:`lightning_ft.step.left_out_parameters`)."""
        kwargs = lightning_internals.ddp_kwargs(self)
        search = search_for_unused_parameters(
            model, kwargs, chosen_by_default=self._unused_search_by_default, per_step=not self.algorithm.semi_sync
        )
        kwargs["find_unused_parameters"] = search
        self._torch_note_pending = search and self._unused_search_by_default
        return model


#: FTStrategy's own arguments, by name: the constructor hands them to :mod:`lightning_ft.configuration`, the rest
#: (``**kwargs``) go on to DDPStrategy as a copy (LightningCLI's signature reader gives up on a call that forwards
#: ``name=kwargs``); the suggestions for a misspelled one.
OWN_ARGUMENTS = tuple(
    name for name in inspect.signature(FTStrategyArguments.__init__).parameters if name not in ("self", "kwargs")
)

"""Every FTStrategy setting in one place: environment fallbacks and validation.

Settings arrive from three places: constructor arguments (and so LightningCLI YAML), environment variables set by a
launcher (``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``LIGHTNING_FT_HOSTNAME``), and
defaults. They are resolved and checked once, up front, so that a wrong value fails at construction with a message
that names the setting and the fix, instead of as a hang or a cryptic error deep inside torchft minutes later.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, get_args

from lightning_ft.errors import LightningFTError
from lightning_ft_job.addresses import LOOPBACK, interface_address
from lightning_ft_job.environment import (
    ENV_HOSTNAME,
    ENV_INTERFACE,
    ENV_LIGHTHOUSE,
    ENV_NUM_REPLICA_GROUPS,
    ENV_REPLICA_GROUP_ID,
    ENV_START_TIMEOUT,
)

# Every FTStrategy setting that takes one of a few strings, as a Literal (LightningCLI then offers and checks the
# choices) and as the tuple of its choices that the resolvers check.
ProcessGroupName = Literal["auto", "gloo", "nccl"]
TransportName = Literal["http", "pg"]
WorldSizeModeName = Literal["dynamic", "fixed_with_spares"]
BufferSyncName = Literal["average", "off"]  # how buffers cross groups (lightning_ft.step.buffers)
DataModeName = Literal["sharded", "exactly_once"]  # lightning_ft.data.placement
AlgorithmName = Literal["ddp", "local_sgd", "diloco"]  # lightning_ft.algorithms
DataParallelName = Literal["ddp", "fsdp"]  # inside a group: lightning_ft.hsdp.data_parallel

PROCESS_GROUPS: tuple[str, ...] = get_args(ProcessGroupName)
TRANSPORTS: tuple[str, ...] = get_args(TransportName)
WORLD_SIZE_MODES: tuple[str, ...] = get_args(WorldSizeModeName)
BUFFER_SYNC_MODES: tuple[str, ...] = get_args(BufferSyncName)
DATA_MODES: tuple[str, ...] = get_args(DataModeName)
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
DATA_PARALLEL: tuple[str, ...] = get_args(DataParallelName)


# Long enough for a scheduler to place a job's nodes one by one (and for Kubernetes to reschedule a pod after a node
# failure, about 5 minutes); short enough that a group that never comes does not hold the others for long.
DEFAULT_START_TIMEOUT_S = 300.0


class FTConfigError(LightningFTError, ValueError):
    """A lightning-ft setting has a value that cannot work. The message names the setting and the fix.

    Raised by ``FTStrategy(...)``, by the callbacks' constructors and :class:`~lightning_ft.Failure`, and, when the fit
    starts, for a Trainer, model or dataloader setting that the strategy's settings cannot work with.
    """


def _int_from_env(name: str, env: str, value: int | None, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise FTConfigError(f"{name}: environment variable {env}={raw!r} is not an integer.") from None


def _positive_seconds(name: str, seconds: float) -> timedelta:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
        raise FTConfigError(f"{name}={seconds!r}: must be a positive number of seconds, for example {name}=30.")
    return timedelta(seconds=float(seconds))


@dataclass(frozen=True)
class FTSettings:
    """The resolved, validated settings of one replica group member."""

    replica_group_id: int
    num_replica_groups: int
    lighthouse: str | None
    min_replica_size: int
    use_async_quorum: bool
    timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    init_sync: bool
    max_retries: int | None
    process_group: ProcessGroupName
    checkpoint_transport: TransportName
    # Chosen (argument or LIGHTNING_FT_HOSTNAME), or None: decided at setup by `advertised_hostname`, once the
    # number of nodes is known.
    hostname: str | None
    replica_id_prefix: str
    skip_non_finite_steps: bool
    lighthouse_outage_timeout: timedelta | None
    # torchft's WorldSizeMode: "dynamic" averages over every participating group; "fixed_with_spares" lets exactly
    # min_replica_size groups contribute, the others are spares that stay healed and contribute zero.
    world_size_mode: WorldSizeModeName
    # How long the first committed step waits for every group to start (lightning_ft.start.decision); 0: not at all.
    start_timeout: timedelta
    # "average": each vote averages the buffers' change over the job (lightning_ft.step.buffers); "off": each replica
    # keeps its own.
    buffer_sync: BufferSyncName

    @property
    def replica_id(self) -> str:
        """The id this group registers with the lighthouse.

        torchft derives a global rank from its trailing digits, so the group id goes last. It is zero-padded
        because torchft orders a quorum's participants by id as text: padded, participant rank 0 is the
        lowest-numbered group (the checkpoint writer) even beyond ten groups.
        """
        return f"{self.replica_id_prefix}{self.replica_group_id:05d}"

    @property
    def needs_embedded_lighthouse(self) -> bool:
        return self.lighthouse is None

    def advertised_hostname(self, num_nodes: int) -> str:
        """The address this group gives its peers for healing, its store and its ManagerServer.

        A job with the embedded lighthouse on one node has no peers on other machines, so it advertises (and binds,
        see :mod:`lightning_ft.manager.listeners`) loopback. Otherwise the machine's hostname, as torchft does.
        """
        if self.hostname is not None:
            return self.hostname
        if self.needs_embedded_lighthouse and num_nodes == 1:
            return LOOPBACK
        return socket.gethostname()


def _advertised_address(hostname: str | None, interface: str | None) -> str | None:
    """The address a group advertises when one was chosen: by name or address (``hostname``, then
    ``LIGHTNING_FT_HOSTNAME``), or by network interface (``interface``, then ``LIGHTNING_FT_INTERFACE``), whose IPv4
    address is then used. An explicit argument wins over the environment; both kinds at once is an error."""
    if hostname and interface:
        raise FTConfigError(
            f"hostname={hostname!r} and interface={interface!r}: choose the advertised address one way, not both."
        )
    if hostname:
        return hostname
    if not interface:
        hostname = os.environ.get(ENV_HOSTNAME) or None
        interface = os.environ.get(ENV_INTERFACE) or None
        if hostname and interface:
            raise FTConfigError(
                f"{ENV_HOSTNAME}={hostname!r} and {ENV_INTERFACE}={interface!r} are both set: choose the advertised "
                f"address one way, not both."
            )
        if hostname:
            return hostname
    if not interface:
        return None
    try:
        return interface_address(interface)
    except ValueError as error:
        raise FTConfigError(
            f"interface={interface!r} (or {ENV_INTERFACE}): {error}. Name the interface on the network that the other "
            f"groups reach this one by, or set hostname= instead."
        ) from None


def resolve_settings(
    *,
    replica_group_id: int | None,
    num_replica_groups: int | None,
    lighthouse: str | None,
    min_replica_size: int,
    use_async_quorum: bool,
    timeout: float,
    quorum_timeout: float,
    connect_timeout: float,
    init_sync: bool,
    max_retries: int | None,
    process_group: ProcessGroupName,
    checkpoint_transport: TransportName,
    hostname: str | None,
    replica_id_prefix: str,
    skip_non_finite_steps: bool,
    lighthouse_outage_timeout: float | None,
    interface: str | None,
    world_size_mode: WorldSizeModeName,
    start_timeout: float | None,
    buffer_sync: BufferSyncName,
) -> FTSettings:
    """Apply environment fallbacks and validate. Raises :class:`FTConfigError` naming the bad setting.

    Every argument is FTStrategy's of the same name; its default is FTStrategy's (its one definition)."""
    group_id = _int_from_env("replica_group_id", ENV_REPLICA_GROUP_ID, replica_group_id, 0)
    num_groups = _int_from_env("num_replica_groups", ENV_NUM_REPLICA_GROUPS, num_replica_groups, 1)
    lighthouse = lighthouse or os.environ.get(ENV_LIGHTHOUSE) or None

    if num_groups < 1:
        raise FTConfigError(f"num_replica_groups={num_groups}: must be at least 1.")
    if not 0 <= group_id < num_groups:
        raise FTConfigError(
            f"replica_group_id={group_id} is outside [0, num_replica_groups={num_groups}). Give each group a distinct "
            f"id below num_replica_groups (env {ENV_REPLICA_GROUP_ID} / {ENV_NUM_REPLICA_GROUPS})."
        )
    if min_replica_size < 1:
        raise FTConfigError(f"min_replica_size={min_replica_size}: must be at least 1.")
    if min_replica_size > num_groups:
        raise FTConfigError(
            f"min_replica_size={min_replica_size} is larger than num_replica_groups={num_groups}: no step could ever "
            f"commit. Lower min_replica_size or raise num_replica_groups."
        )
    if lighthouse is None and num_groups > 1:
        raise FTConfigError(
            f"num_replica_groups={num_groups} needs one lighthouse shared by every group, but none was given. Set "
            f"FTStrategy(lighthouse='http://host:port') or {ENV_LIGHTHOUSE}, or start the groups with "
            f"`lightning-ft launch`, which runs one for you."
        )
    if lighthouse is not None and not lighthouse.startswith(("http://", "https://")):
        raise FTConfigError(f"lighthouse={lighthouse!r}: expected a URL such as 'http://lighthouse-host:29510'.")
    if process_group not in PROCESS_GROUPS:
        raise FTConfigError(f"process_group={process_group!r}: choose one of {', '.join(PROCESS_GROUPS)}.")
    if checkpoint_transport not in TRANSPORTS:
        raise FTConfigError(f"checkpoint_transport={checkpoint_transport!r}: choose one of {', '.join(TRANSPORTS)}.")
    if max_retries is not None and max_retries < 0:
        raise FTConfigError(f"max_retries={max_retries}: must be None (retry forever) or a non-negative integer.")
    if world_size_mode not in WORLD_SIZE_MODES:
        raise FTConfigError(
            f"world_size_mode={world_size_mode!r}: choose one of {', '.join(WORLD_SIZE_MODES)} (fixed_with_spares: "
            f"exactly min_replica_size groups contribute, the rest are hot spares)."
        )
    if buffer_sync not in BUFFER_SYNC_MODES:
        raise FTConfigError(
            f"buffer_sync={buffer_sync!r}: choose 'average' (every committed step averages the buffers' change over "
            f"the job, so every replica holds the same BatchNorm statistics) or 'off' (each replica keeps its own)."
        )
    hostname = _advertised_address(hostname, interface)
    start_timeout = _start_timeout(start_timeout)

    return FTSettings(
        replica_group_id=group_id,
        num_replica_groups=num_groups,
        lighthouse=lighthouse,
        min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=_positive_seconds("timeout", timeout),
        quorum_timeout=_positive_seconds("quorum_timeout", quorum_timeout),
        connect_timeout=_positive_seconds("connect_timeout", connect_timeout),
        init_sync=init_sync,
        max_retries=max_retries,
        process_group=process_group,
        checkpoint_transport=checkpoint_transport,
        hostname=hostname,
        replica_id_prefix=replica_id_prefix,
        skip_non_finite_steps=bool(skip_non_finite_steps),
        lighthouse_outage_timeout=(
            None
            if lighthouse_outage_timeout is None
            else _positive_seconds("lighthouse_outage_timeout", lighthouse_outage_timeout)
        ),
        world_size_mode=world_size_mode,
        start_timeout=timedelta(seconds=start_timeout),
        buffer_sync=buffer_sync,
    )


def _start_timeout(value: float | None) -> float:
    """``start_timeout`` from the argument, else ``LIGHTNING_FT_START_TIMEOUT``, else the default; 0 or more."""
    source = "start_timeout"
    if value is None:
        raw = os.environ.get(ENV_START_TIMEOUT)
        if raw is None or raw == "":
            return DEFAULT_START_TIMEOUT_S
        source = f"environment variable {ENV_START_TIMEOUT}"
        try:
            value = float(raw)
        except ValueError:
            raise FTConfigError(f"{source}={raw!r} is not a number of seconds, for example 300.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise FTConfigError(
            f"{source}={value!r}: must be 0 or more seconds (0 starts the job as soon as any group is up), "
            f"for example start_timeout=300."
        )
    return float(value)

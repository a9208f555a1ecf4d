"""Build one torchft ``Manager`` per replica group from :class:`~lightning_ft.settings.FTSettings`.

The Manager needs three things from its surroundings, and each has a trap this module avoids:

* **A TCPStore for the group.** torchft reads ``MASTER_ADDR/MASTER_PORT`` by default, which under torchrun is the
  elastic agent's store. That store outlives worker restarts, so after a restart the non-zero ranks read the dead
  ManagerServer's address from it and fail to connect. Group rank 0 therefore hosts a *fresh* store on a free port
  for every process lifetime and shares its address over the group's own process group.
* **A cross-group process group.** It links rank *r* of every group with rank *r* of the others; it never replaces
  the torch default process group, which stays inside the group.
* **A lighthouse.** When none is configured and the job is a single group, one is started in process. An external
  one may go away and come back: the quorum requests ride out the outage
  (:mod:`lightning_ft.manager.lighthouse_outage`).

Two more things a healing group must get right, which torchft 0.2.0 leaves to its caller:

* **Loading the peer's state safely.** torchft's HTTP transport unpickles it with ``weights_only=False``, which
  runs whatever code the bytes name, from whichever address the quorum gave. The training state lightning-ft sends
  is plain data, so :class:`~lightning_ft.manager.http_transport.CheckpointHTTPTransport` loads it with
  ``weights_only=True``. (The ``pg`` transport
  unpickles only torchft's small metadata record with :mod:`pickle`, over the job's own cross-group process group;
  its tensors arrive as raw bytes. That is torchft's code and is left as it is.)
* **Refusing a peer whose model differs before the first collective**: :class:`FTManager` vets the received state as
  soon as the quorum is known (:mod:`lightning_ft.manager.ft_manager`).

Peers reach a group at its advertised address (``FTSettings.advertised_hostname``): its store, Manager server, HTTP
checkpoint server and cross-group Gloo process group all follow it, so one setting makes a group reachable from
another host (see :mod:`lightning_ft.manager.listeners`; ``test_network_partition.py`` runs groups in separate
network namespaces, where torchft's defaults are unreachable).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft.checkpointing import CheckpointTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.manager import WorldSizeMode
from torchft.process_group import ProcessGroup

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.ft_manager import FTManager
from lightning_ft.manager.group_claim import GroupClaimCheck
from lightning_ft.manager.http_transport import CheckpointHTTPTransport
from lightning_ft.manager.internals import (
    abort_cross_group_process_group,
    install_client,
    left_behind_watch,
    lifetime_replica_id,
    manager_client,
    new_manager_client,
    quorum_threads,
)
from lightning_ft.manager.lighthouse_outage import OutageTolerantClient, lighthouse_reachable
from lightning_ft.manager.listeners import AddressedProcessGroupGloo, group_store, manager_server_bound_to
from lightning_ft.manager.local_vote import LocalCommitVote
from lightning_ft.manager.quorum_kind import install_quorum_kind_check
from lightning_ft.manager.quorum_members import QuorumMembers
from lightning_ft.manager.telemetry import TimedTransport
from lightning_ft.manager.torchft_logs import quiet_torchft_logs
from lightning_ft.manager.vote_inputs import VoteInputs
from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo, StoreCheckedProcessGroupNCCL
from lightning_ft.settings import FTConfigError, FTSettings
from lightning_ft_job.addresses import is_loopback, numeric_host
from lightning_ft_job.lighthouse_server import EmbeddedLighthouse, start_lighthouse

log = logging.getLogger("lightning.pytorch.lightning_ft")

# How long a fit's teardown waits for torchft's quorum thread: a quorum request fails as soon as the ManagerServer it
# waits on has stopped.
QUORUM_THREAD_STOP_TIMEOUT_S = 10.0


@dataclass
class ManagerHandle:
    """The Manager together with the resources this process owns for it, so they are torn down together."""

    manager: FTManager
    # Held, not used: on group rank 0 this object *is* the group's store server, which lives as long as it does.
    store: TCPStore | None = None
    lighthouse: EmbeddedLighthouse | None = None
    # The Manager's checkpoint transport, which times each heal's receive (lightning_ft.manager.telemetry).
    transport: TimedTransport | None = None
    outage_client: OutageTolerantClient | None = None

    def shutdown(self) -> None:
        watch = left_behind_watch(self.manager)
        if watch is not None:
            watch.shutdown()
        threads = quorum_threads(self.manager)
        self.manager.shutdown(wait=False)  # the ManagerServer stops: a quorum request still waiting on it fails
        if self.outage_client is not None:
            self.outage_client.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        deadline = time.monotonic() + QUORUM_THREAD_STOP_TIMEOUT_S
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning(
                    "lightning-ft: torchft's quorum thread did not stop within %.0f s of the Manager's shutdown; it "
                    "ends with its quorum request (quorum_timeout)",
                    QUORUM_THREAD_STOP_TIMEOUT_S,
                )
        with contextlib.suppress(Exception):  # a group that failed may already have aborted it
            abort_cross_group_process_group(self.manager)  # its Gloo listener closes now, not when collected
        self.store = None  # on group rank 0, the group's store server: its port closes with it


def build_cross_group_process_group(settings: FTSettings, device: torch.device, hostname: str) -> ProcessGroup:
    """The reconfigurable process group that carries collectives between replica groups.

    Gloo binds to the advertised address when the user chose one or it is loopback, unless ``GLOO_SOCKET_IFNAME``
    says otherwise; by default it keeps its own choice (the address the machine's name resolves to). Every variant
    fails a reconfiguration through a dead primary's store at once (:mod:`lightning_ft.process_group.quorum_store`). On
    torchft 0.3, where each process group hosts a rendezvous store, that store follows the advertised address too.
    """
    process_group = _cross_group_process_group(settings, device, hostname)
    process_group.advertise_rendezvous_store(hostname, functools.partial(group_store, hostname))
    return process_group


def _cross_group_process_group(
    settings: FTSettings, device: torch.device, hostname: str
) -> StoreCheckedProcessGroupGloo | StoreCheckedProcessGroupNCCL:
    name = settings.process_group
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl":
        if device.type != "cuda":
            raise FTConfigError(f"process_group='nccl' needs a CUDA device, but this process trains on {device}.")
        return StoreCheckedProcessGroupNCCL(timeout=settings.timeout)
    chosen = settings.hostname is not None or is_loopback(hostname)
    if chosen and not os.environ.get("GLOO_SOCKET_IFNAME"):
        return AddressedProcessGroupGloo(hostname, timeout=settings.timeout)
    return StoreCheckedProcessGroupGloo(timeout=settings.timeout)


def checkpoint_transport(
    settings: FTSettings, pg: ProcessGroup, device: torch.device, hostname: str
) -> CheckpointTransport:
    """How a healing group receives a live peer's state: over HTTP, or over the cross-group process group."""
    if settings.checkpoint_transport == "pg":
        return PGTransport(pg, timeout=settings.timeout, device=device)
    return CheckpointHTTPTransport(hostname, timeout=settings.timeout)


def _fresh_group_store(group_rank: int, group_world_size: int, hostname: str) -> tuple[TCPStore | None, str, int]:
    """Group rank 0 hosts a new TCPStore; every rank learns its address through the group's process group."""
    store: TCPStore | None = None
    address: list[object] = [None]
    if group_rank == 0:
        store = group_store(hostname)
        address[0] = (hostname, store.port)
    if group_world_size > 1:
        dist.broadcast_object_list(address, src=0)
    host, port = cast(tuple[str, int], address[0])
    return store, str(host), int(port)


def build_manager(
    settings: FTSettings, group_rank: int, group_world_size: int, device: torch.device, num_nodes: int = 1
) -> ManagerHandle:
    """Create this process's Manager. Must run after the group's default process group exists.

    The state-dict callbacks are registered later (see :mod:`lightning_ft.callbacks.transfer`), once the model and
    optimizers exist. ``num_nodes`` is the group's node count: a one-node group with the embedded lighthouse keeps
    every listener on loopback.
    """
    quiet_torchft_logs()
    hostname = settings.advertised_hostname(num_nodes)
    if is_loopback(hostname):  # `localhost` may resolve to ::1 on some machines and 127.0.0.1 on others
        hostname = numeric_host(hostname)
    lighthouse: EmbeddedLighthouse | None = None
    lighthouse_addr = settings.lighthouse
    if settings.needs_embedded_lighthouse and group_rank == 0:
        lighthouse = start_lighthouse(min_replicas=1)
        lighthouse_addr = lighthouse.address
        log.info(
            "lightning-ft: no lighthouse configured; started one in process at %s (status page: %s/)",
            lighthouse_addr,
            lighthouse_addr,
        )

    store, store_host, store_port = _fresh_group_store(group_rank, group_world_size, hostname)
    pg = build_cross_group_process_group(settings, device, hostname)
    transport: TimedTransport[Any] = TimedTransport(checkpoint_transport(settings, pg, device, hostname))
    with manager_server_bound_to(hostname), lighthouse_reached(lighthouse_addr, settings):
        manager = FTManager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=settings.min_replica_size,
            use_async_quorum=settings.use_async_quorum,
            timeout=settings.timeout,
            quorum_timeout=settings.quorum_timeout,
            connect_timeout=settings.connect_timeout,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            replica_id=settings.replica_id,
            hostname=hostname,
            checkpoint_transport=transport,
            init_sync=settings.init_sync,
            max_retries=settings.max_retries,
            world_size_mode=WorldSizeMode.FIXED_WITH_SPARES
            if settings.world_size_mode == "fixed_with_spares"
            else WorldSizeMode.DYNAMIC,
        )
    client, outage_client = composed_client(
        manager_client(manager),
        settings,
        group_world_size,
        new_client=new_manager_client(manager, settings.connect_timeout) if settings.lighthouse is not None else None,
        replica_id=lifetime_replica_id(manager) if settings.lighthouse is not None else None,
    )
    install_client(manager, client)
    install_quorum_kind_check(manager, device)  # the first observer: its exchange opens every new process group
    watch = left_behind_watch(manager)
    if watch is not None:  # the process group exists before the Manager: its events name the Manager's step
        watch.current_step = manager.current_step
    return ManagerHandle(
        manager=manager, store=store, lighthouse=lighthouse, transport=transport, outage_client=outage_client
    )


class LighthouseUnreachableError(LightningFTError, ConnectionError):
    """The group's ManagerServer could not connect to the lighthouse it was given within ``connect_timeout``."""


@contextlib.contextmanager
def lighthouse_reached(lighthouse_addr: str | None, settings: FTSettings) -> Iterator[None]:
    """When the Manager's construction fails and the lighthouse does not accept a connection (checked here, not read
    from torchft's message), raise an error that names the lighthouse, the settings that chose it and the fix."""
    try:
        yield
    except RuntimeError as error:
        if not lighthouse_addr or lighthouse_reachable(lighthouse_addr):
            raise
        seconds = settings.connect_timeout.total_seconds()
        raise LighthouseUnreachableError(
            f"lightning-ft: cannot reach the lighthouse at {lighthouse_addr} within connect_timeout={seconds:g}s. It "
            f"is set by FTStrategy(lighthouse=...) or the TORCHFT_LIGHTHOUSE environment variable. Start it first "
            f"(`lightning-ft lighthouse`; `lightning-ft launch` starts one for you), or point the setting at the one "
            f"that runs: its status page answers at {lighthouse_addr.rstrip('/')}/ in a browser. (torchft: {error})"
        ) from error


def composed_client(
    client: Any,
    settings: FTSettings,
    group_world_size: int,
    new_client: Callable[[], Any] | None = None,
    replica_id: str | None = None,
) -> tuple[Any, OutageTolerantClient | None]:
    """The Manager's RPC client, wrapped once for everything lightning-ft changes about its requests.

    * With an external lighthouse, quorum requests ride out its outages
      (:class:`~lightning_ft.manager.lighthouse_outage.OutageTolerantClient`). The quorum request is the only RPC
      that depends on the lighthouse, and torchft makes it from its own quorum thread (a step's quorum, a sync
      section's, a semi-synchronous sync's), so the client is the one place that sees every one of them. An
      embedded lighthouse lives and dies with this process: nothing to ride out. ``new_client`` makes a second
      connection to the same ManagerServer, with which the wrapper releases a request an outage left hanging.
    * With an external lighthouse, each quorum answer is checked for another live process group claiming this
      group's id (:class:`~lightning_ft.manager.group_claim.GroupClaimCheck`, given this lifetime's ``replica_id``).
    * A one-process group takes its commit vote in process (:class:`~lightning_ft.manager.local_vote.LocalCommitVote`).
    * Each quorum answer's members are remembered (:class:`~lightning_ft.manager.quorum_members.QuorumMembers`), for
      the job's last step.
    * Outermost, this process's own vote inputs are read after torchft's device sync
      (:class:`~lightning_ft.manager.vote_inputs.VoteInputs`).

    Returns the client to install and the outage wrapper (to shut down with the Manager), if any.
    """
    outage_client = None
    if settings.lighthouse is not None:
        outage_timeout = settings.lighthouse_outage_timeout
        outage_client = client = OutageTolerantClient(
            client,
            settings.lighthouse,
            None if outage_timeout is None else outage_timeout.total_seconds(),
            new_client=new_client,
        )
        if replica_id is not None:
            client = GroupClaimCheck(client, settings.lighthouse, replica_id)
    if group_world_size == 1:
        client = LocalCommitVote(client)
    return VoteInputs(QuorumMembers(client)), outage_client

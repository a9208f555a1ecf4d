"""Build one torchft ``Manager`` per replica group from :class:`~lightning_ft.settings.FTSettings`.

The Manager needs three things from its surroundings, and each has a trap this module avoids:

* **A TCPStore for the group.** torchft reads ``MASTER_ADDR/MASTER_PORT`` by default, which under torchrun is the
  elastic agent's store. That store outlives worker restarts, so after a restart the non-zero ranks read the dead
  ManagerServer's address from it and fail to connect. Group rank 0 therefore hosts a *fresh* store on a free port
  for every process lifetime and shares its address over the group's own process group.
* **A cross-group process group.** It links rank *r* of every group with rank *r* of the others; it never replaces
  the torch default process group, which stays inside the group.
* **A lighthouse.** When none is configured and the job is a single group, one is started in process. An external
  one may go away and come back: the quorum requests ride out the outage (:mod:`lightning_ft.lighthouse_outage`).

Two more things a healing group must get right, which torchft 0.2.0 leaves to its caller:

* **Loading the peer's state safely.** torchft's HTTP transport unpickles it with ``weights_only=False``, which
  runs whatever code the bytes name, from whichever address the quorum gave. The training state lightning-ft sends
  is plain data, so :class:`~lightning_ft.http_transport.CheckpointHTTPTransport` loads it with
  ``weights_only=True``. (The ``pg`` transport
  unpickles only torchft's small metadata record with :mod:`pickle`, over the job's own cross-group process group;
  its tensors arrive as raw bytes. That is torchft's code and is left as it is.)
* **Refusing a peer whose model differs before the first collective.** With an asynchronous quorum, torchft loads
  the peer's state only at the commit vote, after the gradient allreduce; a model of another shape reaches that
  allreduce first, where Gloo aborts the *healthy* peer's process on the size mismatch. :class:`FTManager` runs the
  registered checks on the received state as soon as the quorum is known, so the healing group fails alone, with
  an error naming the parameter and both shapes.

Peers reach a group at its advertised address (``FTSettings.advertised_hostname``): its store, Manager server, HTTP
checkpoint server and cross-group Gloo process group all follow it, so one setting makes a group reachable from
another host (see :mod:`lightning_ft.listeners`; tests/test_network_partition.py runs groups in separate network
namespaces, where torchft's defaults are unreachable).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft import Manager
from torchft.checkpointing import CheckpointTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.manager import WorldSizeMode
from torchft.process_group import ProcessGroup
from typing_extensions import override

from lightning_ft.http_transport import CheckpointHTTPTransport, RefusedPeerStateError
from lightning_ft.lighthouse_outage import OutageTolerantClient
from lightning_ft.listeners import AddressedProcessGroupGloo, group_store, manager_server_bound_to
from lightning_ft.local_vote import vote_locally
from lightning_ft.quorum_store import StoreCheckedProcessGroupGloo, StoreCheckedProcessGroupNCCL
from lightning_ft.settings import FTSettings
from lightning_ft.telemetry import TimedTransport
from lightning_ft_job.addresses import is_loopback, numeric_host
from lightning_ft_job.lighthouse_server import EmbeddedLighthouse, start_lighthouse

log = logging.getLogger(__name__)


class FTManager(Manager):
    """torchft's Manager, vetting a healing replica's received state before anything else happens with it.

    Relies on two attributes of torchft 0.2.0's Manager (``_healing``, ``_pending_state_dict``): the quorum thread
    stores the received state there, and the Manager loads it later on the training thread
    (``_apply_pending_state_dict``, overridden here to vet first).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heal_checks: dict[str, Callable[[Any], Any]] = {}
        self._vetted: int | None = None  # id() of the received state last checked (a reference would pin it)

    def register_heal_check(self, key: str, check: Callable[[Any], Any]) -> None:
        """``check(state)`` raises if the state received under ``key`` must not be loaded into this replica."""
        self._heal_checks[key] = check

    @override
    def wait_quorum(self) -> None:
        """Wait for the quorum, as torchft does, then vet a heal right away: every cross-group collective
        (``allreduce``) waits here first, so a state that cannot be loaded stops this replica before it exchanges
        anything with its peers."""
        super().wait_quorum()
        self._vet_heal()

    @override
    def _apply_pending_state_dict(self) -> None:
        """Vet, then load as torchft does. Reached even when no collective ran (a failed fetch skips them)."""
        assert self._quorum_future is not None, "must call start_quorum before applying a heal"
        self._quorum_future.result()
        self._vet_heal()
        super()._apply_pending_state_dict()
        self._vetted = None  # an id() may be reused by a later, unvetted state

    def _vet_heal(self) -> None:
        """Raise if this replica heals and the received state must not be loaded; a no-op otherwise."""
        if not self._healing:
            return
        pending = self._pending_state_dict
        if pending is None:
            error = self.errored()
            if error is not None and isinstance(error.original_exception, RefusedPeerStateError):
                raise error.original_exception  # the same bytes would be refused at every retry
            return
        if id(pending) == self._vetted:
            return
        user_state = pending["user"]
        for key, check in self._heal_checks.items():
            check(user_state[key])
        self._vetted = id(pending)


@dataclass
class ManagerHandle:
    """The Manager together with the resources this process owns for it, so they are torn down together."""

    manager: FTManager
    # Held, not used: on group rank 0 this object *is* the group's store server, which lives as long as it does.
    store: TCPStore | None = None
    lighthouse: EmbeddedLighthouse | None = None
    # The Manager's checkpoint transport, which times each heal's receive (lightning_ft.telemetry).
    transport: TimedTransport | None = None
    outage_client: OutageTolerantClient | None = None

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self.outage_client is not None:
            self.outage_client.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def cross_group_process_group(settings: FTSettings, device: torch.device, hostname: str) -> ProcessGroup:
    """The reconfigurable process group that carries collectives between replica groups.

    Gloo binds to the advertised address when the user chose one or it is loopback, unless ``GLOO_SOCKET_IFNAME``
    says otherwise; by default it keeps its own choice (the address the machine's name resolves to). Every variant
    fails a reconfiguration through a dead primary's store at once (:mod:`lightning_ft.quorum_store`).
    """
    name = settings.process_group
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl":
        if device.type != "cuda":
            raise ValueError(f"process_group='nccl' needs a CUDA device, but this process trains on {device}.")
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
    host, port = address[0]  # type: ignore[misc]
    return store, str(host), int(port)


def build_manager(
    settings: FTSettings, group_rank: int, group_world_size: int, device: torch.device, num_nodes: int = 1
) -> ManagerHandle:
    """Create this process's Manager. Must run after the group's default process group exists.

    The state-dict callbacks are registered later (see :mod:`lightning_ft.callbacks.transfer`), once the model and
    optimizers exist. ``num_nodes`` is the group's node count: a one-node group with the embedded lighthouse keeps
    every listener on loopback.
    """
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
    pg = cross_group_process_group(settings, device, hostname)
    transport = TimedTransport(checkpoint_transport(settings, pg, device, hostname))
    with manager_server_bound_to(hostname):
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
    outage_client = _ride_out_lighthouse_outages(manager, settings)
    vote_locally(manager, group_world_size)  # a one-process group's vote needs no RPC (lightning_ft.local_vote)
    return ManagerHandle(
        manager=manager, store=store, lighthouse=lighthouse, transport=transport, outage_client=outage_client
    )


def _ride_out_lighthouse_outages(manager: Manager, settings: FTSettings) -> OutageTolerantClient | None:
    """Route the Manager's quorum requests through :class:`~lightning_ft.lighthouse_outage.OutageTolerantClient`.

    The quorum request is the only RPC that depends on the lighthouse, and torchft makes it from its own quorum
    thread (a step's quorum, a sync section's, a semi-synchronous sync's), so its client is the one place that sees
    every one of them. ``Manager._client`` is private to torchft 0.2.0, which the project pins. An embedded
    lighthouse lives and dies with this process: nothing to ride out.
    """
    if settings.lighthouse is None:
        return None
    client = OutageTolerantClient(
        manager._client,
        settings.lighthouse,
        None if settings.lighthouse_outage_timeout is None else settings.lighthouse_outage_timeout.total_seconds(),
    )
    manager._client = client
    return client

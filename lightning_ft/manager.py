"""Build one torchft ``Manager`` per replica group from :class:`~lightning_ft.settings.FTSettings`.

The Manager needs three things from its surroundings, and each has a trap this module avoids:

* **A TCPStore for the group.** torchft reads ``MASTER_ADDR/MASTER_PORT`` by default, which under torchrun is the
  elastic agent's store. That store outlives worker restarts, so after a restart the non-zero ranks read the dead
  ManagerServer's address from it and fail to connect. Group rank 0 therefore hosts a *fresh* store on a free port
  for every process lifetime and shares its address over the group's own process group.
* **A cross-group process group.** It links rank *r* of every group with rank *r* of the others; it never replaces
  the torch default process group, which stays inside the group.
* **A lighthouse.** When none is configured and the job is a single group, one is started in process.

Peers reach a group at the address in ``FTSettings.hostname``. torchft uses it for the Manager server and the store,
but its HTTP checkpoint server always advertises ``socket.gethostname()``, and its Gloo process group binds to what
that name resolves to (loopback, where the name maps to 127.0.0.1 as in many containers) unless
``GLOO_SOCKET_IFNAME`` is set. Both follow a chosen ``hostname`` here, so that one setting makes a group reachable
(tests/test_network_partition.py runs groups in separate network namespaces, where the defaults are unreachable).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo
from torch.distributed import Store, TCPStore
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import CheckpointTransport, HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroup

from lightning_ft.lighthouse import EmbeddedLighthouse, start_lighthouse
from lightning_ft.settings import FTSettings

log = logging.getLogger(__name__)


@dataclass
class ManagerHandle:
    """The Manager together with the resources this process owns for it, so they are torn down together."""

    manager: Manager
    # Held, not used: on group rank 0 this object *is* the group's store server, which lives as long as it does.
    store: TCPStore | None = None
    lighthouse: EmbeddedLighthouse | None = None

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def _url_host(hostname: str) -> str:
    """A host as it goes into a URL: an IPv6 literal in brackets."""
    return f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname


class AddressedHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, advertising the group's chosen address.

    torchft's version puts ``socket.gethostname()`` into the URL that healing peers fetch from, whatever the
    Manager's ``hostname``; on a machine whose name resolves elsewhere for the peer (another network namespace,
    another host whose name maps to 127.0.0.1) the heal cannot connect. The server itself listens on every interface.
    """

    def __init__(self, hostname: str, timeout: timedelta, num_chunks: int) -> None:
        self._advertised_host = _url_host(hostname)
        super().__init__(timeout=timeout, num_chunks=num_chunks)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self._advertised_host}:{port}/checkpoint/"


class AddressedProcessGroupGloo(ProcessGroupGloo):
    """torchft's reconfigurable Gloo process group, bound to the group's chosen address.

    Gloo's default device binds to the address the machine's hostname resolves to, or loopback if that address is
    not local, and peers connect to whatever it bound: from another host or namespace, loopback is the peer's own.
    torch's Python constructor only picks a device from ``GLOO_SOCKET_IFNAME`` or that default, so this builds the
    backend with a device for the chosen address instead. The rest mirrors ``torchft.ProcessGroupGloo._create_pg``
    (torchft 0.2.0).
    """

    def __init__(self, hostname: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._hostname = hostname

    def _create_pg(self, store: Store, rank: int, world_size: int) -> dist.ProcessGroup:
        options = BaseProcessGroupGloo._Options()
        options._devices = [BaseProcessGroupGloo.create_device(hostname=self._hostname)]
        options._timeout = self._timeout
        options._threads = 2  # what torch's constructor gives one device
        backend = BaseProcessGroupGloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            backend.options.group_name = (
                f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
            )
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        for device in ("cuda", "xpu"):
            if getattr(torch, device).is_available():
                pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg


def cross_group_process_group(settings: FTSettings, device: torch.device) -> ProcessGroup:
    """The reconfigurable process group that carries collectives between replica groups."""
    name = settings.process_group
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl":
        if device.type != "cuda":
            raise ValueError(f"process_group='nccl' needs a CUDA device, but this process trains on {device}.")
        return ProcessGroupNCCL(timeout=settings.timeout)
    if settings.hostname_chosen and not os.environ.get("GLOO_SOCKET_IFNAME"):
        return AddressedProcessGroupGloo(settings.hostname, timeout=settings.timeout)
    return ProcessGroupGloo(timeout=settings.timeout)


def checkpoint_transport(settings: FTSettings, pg: ProcessGroup, device: torch.device) -> CheckpointTransport:
    """How a healing group receives a live peer's state: over HTTP, or over the cross-group process group."""
    if settings.checkpoint_transport == "pg":
        return PGTransport(pg, timeout=settings.timeout, device=device)
    return AddressedHTTPTransport(settings.hostname, timeout=settings.timeout, num_chunks=0)


def _fresh_group_store(
    settings: FTSettings, group_rank: int, group_world_size: int
) -> tuple[TCPStore | None, str, int]:
    """Group rank 0 hosts a new TCPStore; every rank learns its address through the group's process group."""
    store: TCPStore | None = None
    address: list[object] = [None]
    if group_rank == 0:
        store = TCPStore(host_name=settings.hostname, port=0, is_master=True, wait_for_workers=False)
        address[0] = (settings.hostname, store.port)
    if group_world_size > 1:
        dist.broadcast_object_list(address, src=0)
    host, port = address[0]  # type: ignore[misc]
    return store, str(host), int(port)


def build_manager(settings: FTSettings, group_rank: int, group_world_size: int, device: torch.device) -> ManagerHandle:
    """Create this process's Manager. Must run after the group's default process group exists.

    The state-dict callbacks are registered later (see :mod:`lightning_ft.callbacks.transfer`), once the model and
    optimizers exist.
    """
    lighthouse: EmbeddedLighthouse | None = None
    lighthouse_addr = settings.lighthouse
    if settings.needs_embedded_lighthouse and group_rank == 0:
        lighthouse = start_lighthouse(min_replicas=1)
        lighthouse_addr = lighthouse.address
        log.info("lightning-ft: no lighthouse configured; started one in process at %s", lighthouse_addr)

    store, store_host, store_port = _fresh_group_store(settings, group_rank, group_world_size)
    pg = cross_group_process_group(settings, device)
    manager = Manager(
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
        hostname=settings.hostname,
        checkpoint_transport=checkpoint_transport(settings, pg, device),
        init_sync=settings.init_sync,
        max_retries=settings.max_retries,
    )
    return ManagerHandle(manager=manager, store=store, lighthouse=lighthouse)

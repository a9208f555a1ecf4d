"""Build one torchft ``Manager`` per replica group from :class:`~lightning_ft.settings.FTSettings`.

The Manager needs three things from its surroundings, and each has a trap this module avoids:

* **A TCPStore for the group.** torchft reads ``MASTER_ADDR/MASTER_PORT`` by default, which under torchrun is the
  elastic agent's store. That store outlives worker restarts, so after a restart the non-zero ranks read the dead
  ManagerServer's address from it and fail to connect. Group rank 0 therefore hosts a *fresh* store on a free port
  for every process lifetime and shares its address over the group's own process group.
* **A cross-group process group.** It links rank *r* of every group with rank *r* of the others; it never replaces
  the torch default process group, which stays inside the group.
* **A lighthouse.** When none is configured and the job is a single group, one is started in process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import CheckpointTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroup

from lightning_ft.addresses import is_loopback, numeric_host
from lightning_ft.lighthouse import EmbeddedLighthouse, start_lighthouse
from lightning_ft.listeners import AdvertisedHTTPTransport, group_store, manager_server_bound_to
from lightning_ft.settings import FTSettings
from lightning_ft.telemetry import TimedTransport

log = logging.getLogger(__name__)


@dataclass
class ManagerHandle:
    """The Manager together with the resources this process owns for it, so they are torn down together."""

    manager: Manager
    # Held, not used: on group rank 0 this object *is* the group's store server, which lives as long as it does.
    store: TCPStore | None = None
    lighthouse: EmbeddedLighthouse | None = None
    # The Manager's checkpoint transport, which times each heal's receive (lightning_ft.telemetry).
    transport: TimedTransport | None = None

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def cross_group_process_group(settings: FTSettings, device: torch.device) -> ProcessGroup:
    """The reconfigurable process group that carries collectives between replica groups."""
    name = settings.process_group
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl":
        if device.type != "cuda":
            raise ValueError(f"process_group='nccl' needs a CUDA device, but this process trains on {device}.")
        return ProcessGroupNCCL(timeout=settings.timeout)
    return ProcessGroupGloo(timeout=settings.timeout)


def checkpoint_transport(
    settings: FTSettings, pg: ProcessGroup, device: torch.device, hostname: str
) -> CheckpointTransport:
    """How a healing group receives a live peer's state: over HTTP, or over the cross-group process group."""
    if settings.checkpoint_transport == "pg":
        return PGTransport(pg, timeout=settings.timeout, device=device)
    return AdvertisedHTTPTransport(hostname, timeout=settings.timeout)


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
    pg = cross_group_process_group(settings, device)
    transport = TimedTransport(checkpoint_transport(settings, pg, device, hostname))
    with manager_server_bound_to(hostname):
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
            hostname=hostname,
            checkpoint_transport=transport,
            init_sync=settings.init_sync,
            max_retries=settings.max_retries,
        )
    return ManagerHandle(manager=manager, store=store, lighthouse=lighthouse, transport=transport)

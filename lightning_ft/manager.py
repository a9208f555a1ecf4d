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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import CheckpointTransport, HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroup

from lightning_ft.lighthouse import EmbeddedLighthouse, start_lighthouse
from lightning_ft.lighthouse_outage import OutageTolerantClient
from lightning_ft.settings import FTSettings

log = logging.getLogger(__name__)


@dataclass
class ManagerHandle:
    """The Manager together with the resources this process owns for it, so they are torn down together."""

    manager: Manager
    # Held, not used: on group rank 0 this object *is* the group's store server, which lives as long as it does.
    store: TCPStore | None = None
    lighthouse: EmbeddedLighthouse | None = None
    outage_client: OutageTolerantClient | None = None

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self.outage_client is not None:
            self.outage_client.shutdown()
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


def checkpoint_transport(settings: FTSettings, pg: ProcessGroup, device: torch.device) -> CheckpointTransport:
    """How a healing group receives a live peer's state: over HTTP, or over the cross-group process group."""
    if settings.checkpoint_transport == "pg":
        return PGTransport(pg, timeout=settings.timeout, device=device)
    return HTTPTransport(timeout=settings.timeout, num_chunks=0)


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
    return ManagerHandle(
        manager=manager,
        store=store,
        lighthouse=lighthouse,
        outage_client=_ride_out_lighthouse_outages(manager, settings),
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

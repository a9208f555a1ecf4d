"""Which process-group API the installed torchft offers, decided once, from what it has (not from version strings).

torchft 0.2 reconfigures its cross-group process groups with ``configure(store_addr, replica_id, rank, world_size,
quorum_id=...)``; the store is the quorum's primary group's TCPStore. torchft 0.3 (and the nightlies before it)
replaced that with ``set_rank_info()``, ``get_reconfigure_handle()`` and ``reconfigure(ReconfigureOptions)``: each
member sends a handle with its quorum request, the quorum answers every member's handle in order, and all members
rendezvous on a TCPStore that the *first member's process group* hosts, under ``/torchft/<quorum id>``.

lightning-ft's bounded waits (:mod:`.quorum_store`) run before either entry point, from the same
four facts: the rendezvous store's address, this member's rank, the world size and the quorum id.
:func:`rendezvous_of` reads them from a ``reconfigure`` call the way torchft itself does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torchft.process_group
from torchft.process_group import ProcessGroupWrapper

from lightning_ft_job.addresses import url_host

CONFIGURE_API: bool = callable(getattr(ProcessGroupWrapper, "configure", None))
RECONFIGURE_API: bool = callable(getattr(ProcessGroupWrapper, "reconfigure", None)) and not CONFIGURE_API

if not (CONFIGURE_API or RECONFIGURE_API):
    raise ImportError(
        "lightning-ft supports torchft 0.2 (process groups with `configure`) and 0.3 (`reconfigure`); the installed "
        "torchft's ProcessGroupWrapper has neither. Install torchft>=0.2.0,<0.4."
    )


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom this member joins a quorum's process group."""

    store_addr: str  # host:port/prefix
    rank: int
    world_size: int
    quorum_id: int


def rendezvous_of(process_group: Any, options: Any) -> Rendezvous:
    """The rendezvous that ``process_group.reconfigure(options)`` will make (torchft ≥ 0.3), read with torchft's own
    parser (``torchft.process_group._rendezvous``) so that both always agree."""
    parsed = torchft.process_group._rendezvous(options, process_group._handle_id())
    return Rendezvous(parsed.store_addr, parsed.rank, parsed.world_size, int(parsed.uuid))


def host_rendezvous_store(process_group: Any, make_store: Any) -> None:
    """Make ``process_group`` host its rendezvous store (torchft ≥ 0.3) on ``make_store()``'s TCPStore server instead
    of the one torchft would open on every interface; once, before torchft's ``get_reconfigure_handle`` opens its
    own. The store lives as long as the process group, as torchft's does."""
    if getattr(process_group, "_rendezvous_store", None) is None:
        process_group._rendezvous_store = make_store()


def readdressed_handle(handle: str, host: str) -> str:
    """A reconfigure handle whose rendezvous store is advertised at ``host`` (same port) instead of torchft's
    ``socket.gethostname()``."""
    fields = json.loads(handle)
    port = str(fields["store"]).rpartition(":")[2]
    fields["store"] = f"{url_host(host)}:{port}"
    return json.dumps(fields)

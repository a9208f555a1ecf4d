"""Where this process's fault-tolerance listeners bind, and the address they advertise to peers.

A replica group opens four listeners of its own besides torch's: the group's TCPStore (group rank 0), torchft's
ManagerServer (group rank 0; quorum and commit RPCs), and the HTTP checkpoint server (every rank; it serves the
*full training state* to any client that asks), and the cross-group Gloo process group (every rank). torchft binds
the ManagerServer and the checkpoint server to every interface, which is wrong for a job that lives on one machine,
where nothing should be reachable from the network; and Gloo binds to whatever the machine's name resolves to, which
is wrong for a group that advertises another address (another network namespace, another interface). This module
handles the store, the ManagerServer and Gloo; :mod:`lightning_ft.manager.http_transport` handles the checkpoint server.

The rule here is simple: a group that advertises a loopback address can only be reached from this machine anyway, so
its listeners bind to that loopback address. Any other advertised address keeps torchft's bind-everything default
(peers on other hosts must reach it; confine it with a firewall, see ``docs/security.md``).

torch's own stores (torchrun's rendezvous store and the ``env://`` store on ``MASTER_PORT``) offer no bind address
and are out of reach here; ``docs/security.md`` lists them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torchft.manager
from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo
from torch.distributed import Store, TCPStore

from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo
from lightning_ft_job.addresses import family_of, is_loopback, numeric_host, url_host


def group_store(hostname: str) -> TCPStore:
    """The group's fresh TCPStore server, on loopback when ``hostname`` is loopback, else on every interface.

    ``TCPStore`` has no bind-address argument but accepts a socket that is already listening.
    """
    if not is_loopback(hostname):
        return TCPStore(host_name=hostname, port=0, is_master=True, wait_for_workers=False)
    host = numeric_host(hostname)
    listener = socket.socket(family_of(host), socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(socket.SOMAXCONN)
        store = TCPStore(
            host_name=host,
            port=listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    # The store serves on this fd from now on; the Python object must not close it when it is garbage-collected.
    listener.detach()
    return store


@contextmanager
def manager_server_bound_to(hostname: str) -> Iterator[None]:
    """While a ``torchft.Manager`` is built, bind its ManagerServer to ``hostname`` if that is loopback.

    torchft 0.2.0 hardcodes ``bind=f"[::]:{port}"`` in ``Manager.__init__``. Rather than copy the constructor, this
    rewrites that one argument for the duration of the call, on the module attribute the constructor looks up.
    Remove once torchft's Manager takes a bind address.
    """
    if not is_loopback(hostname):
        yield
        return
    original = torchft.manager.ManagerServer
    host = url_host(numeric_host(hostname))

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return original(*args, bind=f"{host}:{port}", **kwargs)

    torchft.manager.ManagerServer = bound_server
    try:
        yield
    finally:
        torchft.manager.ManagerServer = original


class AddressedProcessGroupGloo(StoreCheckedProcessGroupGloo):
    """torchft's reconfigurable Gloo process group, bound to the group's chosen address.

    Gloo's default device binds to the address the machine's hostname resolves to, or loopback if that address is
    not local, and peers connect to whatever it bound: from another host or namespace, loopback is the peer's own.
    torch's Python constructor only picks a device from ``GLOO_SOCKET_IFNAME`` or that default, so this builds the
    backend with a device for the chosen address instead. The rest mirrors ``torchft.ProcessGroupGloo._create_pg``
    (torchft 0.2.0; 0.3 names the group after its uuid, which is the quorum id).
    """

    def __init__(self, hostname: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._hostname = hostname

    def _create_pg(self, store: Store, rank: int, world_size: int) -> dist.ProcessGroup:
        options = BaseProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._devices = [BaseProcessGroupGloo.create_device(hostname=self._hostname)]
        options._timeout = self._timeout
        options._threads = 2  # what torch's constructor gives one device
        backend = BaseProcessGroupGloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            name = f"torchft_quorum_{self.entered_quorum_id}_rank_{self._group_rank % self._group_world_size}"
            backend.options.group_name = name  # type: ignore[assignment]  # a GroupName is a str
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        for device in ("cuda", "xpu"):
            if getattr(torch, device).is_available():
                pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

"""The address a group advertises to its peers: ``hostname`` / ``LIGHTNING_FT_HOSTNAME`` reaches every channel.

torchft puts the chosen hostname into the Manager server's and the store's addresses only; its HTTP checkpoint
server advertises ``socket.gethostname()`` and its Gloo process group binds where that name resolves. These checks
run in one process; tests/strategy/test_network_partition.py shows groups reaching each other across network
namespaces.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import listening_sockets
from torch.distributed import ReduceOp, TCPStore
from torchft_groups import reconfigure_without_manager

from lightning_ft import FTStrategy
from lightning_ft.manager.builder import build_cross_group_process_group, checkpoint_transport
from lightning_ft.manager.http_transport import CheckpointHTTPTransport, stop_serving
from lightning_ft.manager.listeners import AddressedProcessGroupGloo
from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo, store_host_port
from lightning_ft.process_group.torchft_api import RECONFIGURE_API, readdressed_handle

CPU = torch.device("cpu")


def test_the_hostname_defaults_to_the_machine_name_and_is_not_bound_by_gloo(monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_HOSTNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    settings = FTStrategy(lighthouse="http://lighthouse:29510").settings
    assert settings.hostname is None
    hostname = settings.advertised_hostname(num_nodes=1)
    assert hostname == socket.gethostname()
    assert type(build_cross_group_process_group(settings, CPU, hostname)) is StoreCheckedProcessGroupGloo


def test_one_node_with_the_embedded_lighthouse_advertises_loopback(monkeypatch):
    for name in ("LIGHTNING_FT_HOSTNAME", "TORCHFT_LIGHTHOUSE", "NUM_REPLICA_GROUPS", "REPLICA_GROUP_ID"):
        monkeypatch.delenv(name, raising=False)
    settings = FTStrategy().settings
    assert settings.advertised_hostname(num_nodes=1) == "127.0.0.1"
    assert settings.advertised_hostname(num_nodes=2) == socket.gethostname()  # other nodes must reach the store


def test_the_environment_chooses_the_hostname_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_HOSTNAME", "group1.example")
    settings = FTStrategy().settings
    assert settings.hostname == settings.advertised_hostname(num_nodes=4) == "group1.example"
    assert FTStrategy(hostname="10.0.0.7").settings.hostname == "10.0.0.7"


def test_a_chosen_hostname_binds_gloo_unless_gloo_socket_ifname_is_set(monkeypatch):
    settings = FTStrategy(hostname="127.0.0.1").settings
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert isinstance(build_cross_group_process_group(settings, CPU, "127.0.0.1"), AddressedProcessGroupGloo)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # Gloo's own, more specific setting is honoured
    assert type(build_cross_group_process_group(settings, CPU, "127.0.0.1")) is StoreCheckedProcessGroupGloo


def test_the_gloo_group_bound_to_a_chosen_address_configures_and_reduces():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = AddressedProcessGroupGloo("127.0.0.1", timeout=timedelta(seconds=30))
    reconfigure_without_manager(pg, f"127.0.0.1:{store.port}", rank=0, world_size=1, quorum_id=1)
    tensor = torch.arange(4.0)
    pg.allreduce([tensor], ReduceOp.SUM).wait()
    assert torch.equal(tensor, torch.arange(4.0))
    assert pg.getBackendName() == "torchft-gloo"


@pytest.mark.parametrize(("host", "advertised"), [("127.0.0.1", "127.0.0.1:4242"), ("::1", "[::1]:4242")])
def test_a_reconfigure_handle_advertises_the_chosen_host_and_keeps_the_rest(host, advertised):
    handle = json.dumps({"id": "abc", "store": "vm:4242", "global_rank": 3})
    assert json.loads(readdressed_handle(handle, host)) == {"id": "abc", "store": advertised, "global_rank": 3}


@pytest.mark.skipif(
    not RECONFIGURE_API, reason="torchft 0.3's reconfigure handles; 0.2 rendezvouses on the group store"
)
def test_the_rendezvous_store_a_process_group_hosts_listens_on_the_chosen_loopback_address_only():
    """torchft 0.3 opens it on every interface and advertises ``socket.gethostname()``; a group that advertises
    loopback must be reachable there and nowhere else, like its other listeners."""
    settings = FTStrategy(hostname="127.0.0.1").settings
    process_group = build_cross_group_process_group(settings, CPU, "127.0.0.1")
    host, port = store_host_port(json.loads(process_group.get_reconfigure_handle())["store"])
    assert host == "127.0.0.1"
    assert {bound for bound, listening in listening_sockets(os.getpid()) if listening == port} == {"127.0.0.1"}


@pytest.mark.parametrize(("hostname", "host"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_the_checkpoint_server_advertises_the_chosen_address(hostname, host):
    settings = FTStrategy(hostname=hostname).settings
    transport = checkpoint_transport(settings, pg=None, device=CPU, hostname=hostname)  # type: ignore[arg-type]
    assert isinstance(transport, CheckpointHTTPTransport)
    try:
        assert transport.metadata().startswith(f"http://{host}:")
        state = {"weight": torch.arange(6.0).reshape(2, 3)}
        transport.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=timedelta(seconds=30))
        # A peer fetches from the advertised URL; here this process plays the peer.
        received = transport.recv_checkpoint(
            src_rank=0, metadata=transport.metadata(), step=3, timeout=timedelta(seconds=30)
        )
        assert torch.equal(received["weight"], state["weight"])
    finally:
        transport.shutdown(wait=True)


def test_stopping_a_server_does_not_wait_for_its_poll_interval():
    """``stop_serving`` ends ``serve_forever`` at once (a loopback connection wakes its 0.5-s wait): a group moving its
    checkpoint server onto loopback at start pays nothing for it on its way to healing."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 30.0}, daemon=True)
    serving.start()
    stopping = threading.Thread(target=stop_serving, args=(server,), daemon=True)
    stopping.start()
    stopping.join(timeout=5)  # a plain shutdown() would return only after the 30-s poll interval
    assert not stopping.is_alive() and not serving.is_alive()
    server.server_close()

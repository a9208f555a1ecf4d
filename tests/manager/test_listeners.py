"""Where a group's listeners bind: loopback for a one-machine job, torchft's every-interface default otherwise, and
the HTTP checkpoint server advertising the group's chosen address in both cases."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

import lightning.pytorch as pl
import pytest
from helpers import listening_sockets
from helpers import trainer as make_trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ft import FTStrategy
from lightning_ft_cli.group_environment import local_listener_environment
from lightning_ft_job.addresses import is_loopback
from lightning_ft_job.environment import ENV_HOSTNAME


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("10.0.0.5", False),
        ("node-17", False),
        ("", False),
    ],
)
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_a_launcher_with_a_loopback_lighthouse_keeps_groups_on_loopback():
    extra = local_listener_environment("http://127.0.0.1:29510", {})
    assert extra[ENV_HOSTNAME] == "127.0.0.1"
    assert extra.get("GLOO_SOCKET_IFNAME", "lo").startswith("lo")


def test_a_launcher_keeps_what_the_user_set():
    user = {ENV_HOSTNAME: "127.0.0.2", "GLOO_SOCKET_IFNAME": "eth9"}
    assert local_listener_environment("http://localhost:29510", user) == {}
    # A chosen interface is a choice of address too: the launcher must not add a hostname beside it.
    user = {"LIGHTNING_FT_INTERFACE": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert local_listener_environment("http://localhost:29510", user) == {}


def test_a_launcher_with_a_remote_lighthouse_changes_nothing():
    assert local_listener_environment("http://lighthouse.cluster:29510", {}) == {}


class _RecordListeners(pl.Callback):
    """On the first batch, where each of the group's listeners is bound, and what the HTTP server advertises."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}
        self.advertised = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.bound:
            return
        handle = trainer.strategy._fit.handle
        manager = handle.manager
        transport = manager._checkpoint_transport
        ports = {
            "store": handle.store.port,
            "manager server": urlsplit(manager._manager.address()).port,
            "checkpoint server": transport._server.socket.getsockname()[1],
        }
        listening = {port: host for host, port in listening_sockets(os.getpid())}
        self.bound = {name: listening[port] for name, port in ports.items()}
        self.advertised = transport.metadata()


def _fit(tmp_path, hostname: str | None) -> _RecordListeners:
    recorder = _RecordListeners()
    trainer = make_trainer(FTStrategy(hostname=hostname), [recorder], max_steps=2, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    return recorder


@pytest.fixture
def single_group(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", ENV_HOSTNAME):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(120)
def test_a_single_local_group_binds_every_listener_to_loopback(tmp_path, single_group):
    recorder = _fit(tmp_path, hostname=None)
    assert recorder.bound == dict.fromkeys(recorder.bound, "127.0.0.1"), recorder.bound
    assert urlsplit(recorder.advertised).hostname == "127.0.0.1"


@pytest.mark.timeout(120)
def test_a_routable_hostname_keeps_torchfts_bind_everything_and_is_advertised(tmp_path, single_group):
    hostname = socket.gethostname()
    if is_loopback(hostname):
        pytest.fail(f"this test needs a hostname that is not a loopback literal, got {hostname!r}")
    recorder = _fit(tmp_path, hostname=hostname)
    for name, host in recorder.bound.items():
        assert ipaddress.ip_address(host).is_unspecified, f"{name} bound to {host}, expected every interface"
    # torchft's own server would advertise socket.gethostname() whatever the Manager was told; this one follows it.
    assert urlsplit(recorder.advertised).hostname == hostname

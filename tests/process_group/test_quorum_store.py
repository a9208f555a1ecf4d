"""lightning_ft.process_group.quorum_store: a reconfiguration through a dead primary's store fails at once, not after
the timeout.

The store is a real TCPStore server in a process of its own, SIGKILLed by PID before the reconfiguration, and the
process group is lightning-ft's real Gloo process group with a 600-s timeout: torch's TCPStore client would retry the
refused connection for all of it, so the test's 60-s deadline only passes with the fast failure.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torchft_groups import reconfigure_without_manager

from lightning_ft.process_group.quorum_store import (
    QuorumStoreGoneError,
    StoreCheckedProcessGroupGloo,
    fail_if_store_gone,
    store_host_port,
)

# The compatibility matrix runs these on every environment (`make compat`).
pytestmark = pytest.mark.compat

STORE_SERVER = (
    "import sys\n"
    "from torch.distributed import TCPStore\n"
    "store = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(store.port, flush=True)\n"
    "sys.stdin.read()\n"
)


def test_store_addresses_are_split_like_torchft_does():
    assert store_host_port("127.0.0.1:29500/torchft/3/0") == ("127.0.0.1", 29500)
    assert store_host_port("[::1]:29500/torchft/3/0") == ("::1", 29500)
    assert store_host_port("host.example:1") == ("host.example", 1)


def test_a_live_store_passes_the_check():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fail_if_store_gone(f"127.0.0.1:{store.port}/torchft/1/0")


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_a_reconfiguration_through_a_killed_primarys_store_fails_at_once():
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        fail_if_store_gone(f"127.0.0.1:{port}/torchft/1/0")  # alive: passes
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
    process_group = StoreCheckedProcessGroupGloo(timeout=timedelta(seconds=600))
    with pytest.raises(QuorumStoreGoneError, match=f"127.0.0.1:{port} refuses connections"):
        reconfigure_without_manager(process_group, f"127.0.0.1:{port}", rank=1, world_size=2, quorum_id=2)

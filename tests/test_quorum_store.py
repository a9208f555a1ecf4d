"""lightning_ft.quorum_store: a reconfiguration through a dead primary's store fails at once, not after the timeout,
and a rendezvous that the other groups have left behind is given up.

The store is a real TCPStore server in a process of its own, SIGKILLed by PID before the reconfiguration, and the
process group is lightning-ft's real Gloo process group with a 600-s timeout: torch's TCPStore client would retry the
refused connection for all of it, so the test's 60-s deadline only passes with the fast failure.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import AllreduceOptions, TCPStore

from lightning_ft.quorum_store import (
    QuorumStoreGoneError,
    RendezvousLeftBehindError,
    StoreCheckedProcessGroupGloo,
    fail_if_store_gone,
    store_host_port,
)

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
        process_group.configure(f"127.0.0.1:{port}/torchft/2/0", "replica", 0, 2, quorum_id=2)


def member_that_never_comes(quorum_id_now: int, timeout_s: float) -> tuple[StoreCheckedProcessGroupGloo, str]:
    """Rank 0 of a two-member quorum 5 whose other member never connects (it died after asking), on a live store."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    process_group = StoreCheckedProcessGroupGloo(
        timeout=timedelta(seconds=timeout_s), lighthouse="http://lighthouse", read_quorum_id=lambda _: quorum_id_now
    )
    process_group._test_store = store  # type: ignore[attr-defined]  # the server lives as long as the group
    return process_group, f"127.0.0.1:{store.port}/torchft/5/0"


@pytest.mark.timeout(60)
def test_a_rendezvous_the_other_groups_left_behind_is_given_up():
    """The lighthouse is at quorum 6: the others went on. The 600-s rendezvous is given up within the deadline."""
    process_group, address = member_that_never_comes(quorum_id_now=6, timeout_s=600)
    with pytest.raises(RendezvousLeftBehindError, match=r"formed quorum 6 .* quorum 5"):
        process_group.configure(address, "replica", 0, 2, quorum_id=5)
    assert process_group._pg is None


@pytest.mark.timeout(60)
def test_a_rendezvous_the_lighthouse_still_waits_for_runs_to_its_timeout():
    """The lighthouse is still at quorum 5: nothing says the others went on, so the rendezvous keeps its timeout."""
    process_group, address = member_that_never_comes(quorum_id_now=5, timeout_s=3)
    with pytest.raises(Exception) as raised:
        process_group.configure(address, "replica", 0, 2, quorum_id=5)
    assert not isinstance(raised.value, RendezvousLeftBehindError), raised.value


@pytest.mark.timeout(60)
def test_a_rendezvous_with_every_member_builds_a_working_process_group():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [StoreCheckedProcessGroupGloo(timeout=timedelta(seconds=30), lighthouse="http://x") for _ in range(2)]
    results: list[torch.Tensor] = []

    def member(rank: int) -> None:
        groups[rank].configure(f"127.0.0.1:{store.port}/torchft/1/0", f"replica{rank}", rank, 2, quorum_id=1)
        tensor = torch.full((3,), float(rank + 1))
        groups[rank].allreduce([tensor], AllreduceOptions()).wait()
        results.append(tensor)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    assert [t.tolist() for t in results] == [[3.0, 3.0, 3.0]] * 2

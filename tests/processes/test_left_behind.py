"""lightning_ft.step.left_behind: an allreduce the other groups have left behind is given up, not waited out.

Unit tests drive :class:`LeftBehindWatch` with a fake Manager, a fake status-page reader and a fake clock, and real
torch futures; one reads a real lighthouse's status page. The multi-process test (a group stuck in a real job's
allreduce, given up and healed) is in tests/processes/test_failure_injection.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from workers.pending_gloo_worker import FakeManager

from lightning_ft.manager.internals import set_aside_process_group
from lightning_ft.step.left_behind import (
    CollectiveLeftBehindError,
    LeftBehindWatch,
    StatusPageUnreadable,
    lighthouse_quorum,
)
from lightning_ft_job.lighthouse_server import start_lighthouse

LIGHTHOUSE = "http://lighthouse.invalid:1"
REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lighthouse:
    """The status page's quorum id, or an unreadable page; counts how often it was read."""

    def __init__(self, quorum_id: int | None) -> None:
        self.quorum_id = quorum_id
        self.reads = 0

    def __call__(self, url: str) -> int:
        assert url == LIGHTHOUSE
        self.reads += 1
        if self.quorum_id is None:
            raise StatusPageUnreadable("no page")
        return self.quorum_id


def make_watch(lighthouse: Lighthouse, manager: FakeManager | None = None) -> tuple[LeftBehindWatch, Clock]:
    clock = Clock()
    watch = LeftBehindWatch(manager or FakeManager(), LIGHTHOUSE, read_lighthouse_quorum=lighthouse, clock=clock)
    return watch, clock


def doubled(done: torch.futures.Future[Any]) -> torch.Tensor:
    return done.value()[0] * 2


def test_an_allreduce_that_completes_reaches_ddp_through_the_callback_and_the_lighthouse_is_never_read():
    lighthouse = Lighthouse(quorum_id=9)
    watch, clock = make_watch(lighthouse)
    done: torch.futures.Future[Any] = torch.futures.Future()
    result = watch.track(done, torch.ones(2), doubled)
    clock.now += 0.5
    watch.check()  # younger than check_after: nothing to ask
    done.set_result([torch.full((2,), 3.0)])
    clock.now += 5
    watch.check()  # nothing pending any more
    watch.shutdown()
    assert torch.equal(result.wait(), torch.full((2,), 6.0))
    assert lighthouse.reads == 0 and not watch.take_left_behind()


def test_a_pending_allreduce_is_kept_while_the_lighthouse_is_still_at_its_quorum():
    lighthouse = Lighthouse(quorum_id=3)
    manager = FakeManager(quorum_id=3)
    watch, clock = make_watch(lighthouse, manager)
    result = watch.track(torch.futures.Future(), torch.ones(2), doubled)
    clock.now += 1.5
    watch.check()
    watch.shutdown()
    assert lighthouse.reads == 1 and not result.done() and manager.reported == []


def test_an_allreduce_left_behind_is_given_up_with_the_error_reported_first_and_its_late_end_ignored():
    lighthouse = Lighthouse(quorum_id=4)
    manager = FakeManager(quorum_id=3)
    watch, clock = make_watch(lighthouse, manager)
    buffer = torch.full((3,), 5.0)
    done: torch.futures.Future[Any] = torch.futures.Future()
    seen_at_completion: list[int] = []
    result = watch.track(done, buffer, doubled)
    result.add_done_callback(lambda _: seen_at_completion.append(len(manager.reported)))
    clock.now += 1.0
    watch.check()
    watch.shutdown()
    assert result.done() and result.wait() is buffer and torch.equal(buffer, torch.full((3,), 5.0))
    assert seen_at_completion == [1], "the step's error must be known before DDP goes on to the vote"
    [error] = manager.reported
    assert isinstance(error, CollectiveLeftBehindError)
    assert "quorum 4" in str(error) and "quorum 3" in str(error) and "heals" in str(error)
    assert watch.take_left_behind() and not watch.take_left_behind()
    done.set_exception(RuntimeError("Gloo timed out, 60 s later"))  # the given-up allreduce ends by itself
    assert len(manager.reported) == 1 and torch.equal(buffer, torch.full((3,), 5.0))


def test_an_unreadable_status_page_leaves_the_allreduce_to_the_collective_timeout(caplog):
    lighthouse = Lighthouse(quorum_id=None)
    manager = FakeManager()
    watch, clock = make_watch(lighthouse, manager)
    result = watch.track(torch.futures.Future(), torch.ones(1), doubled)
    for _ in range(3):
        clock.now += 1.0
        watch.check()
    watch.shutdown()
    assert lighthouse.reads == 3 and not result.done() and manager.reported == []
    warnings = [r for r in caplog.records if "status page" in r.getMessage()]
    assert len(warnings) == 1 and "FTStrategy(timeout=...)" in warnings[0].getMessage()


def test_the_watchdog_thread_gives_up_on_its_own():
    """The real thread, real clock: an allreduce pending past check_after with a newer quorum is given up."""
    manager = FakeManager(quorum_id=0)
    lighthouse = Lighthouse(quorum_id=1)
    watch = LeftBehindWatch(manager, LIGHTHOUSE, read_lighthouse_quorum=lighthouse, check_after=0.05, interval=0.05)
    result = watch.track(torch.futures.Future(), torch.ones(1), doubled)
    try:
        result.wait()  # returns once the watchdog completes it; the test's timeout bounds it
    finally:
        watch.shutdown()
    assert isinstance(manager.reported[0], CollectiveLeftBehindError)


def test_the_quorum_id_is_read_from_a_real_lighthouse_status_page():
    lighthouse = start_lighthouse(min_replicas=1)
    try:
        assert lighthouse_quorum(lighthouse.address) == 0
    finally:
        lighthouse.shutdown()


def test_an_unreachable_lighthouse_is_unreadable_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(StatusPageUnreadable, match=f"127.0.0.1:{port}/status"):
            lighthouse_quorum(f"http://127.0.0.1:{port}", timeout=5)


class Wrapper:
    """torchft's reconfigurable process group: the Gloo group it holds, and its timeout."""

    def __init__(self) -> None:
        from datetime import timedelta

        self._pg: object | None = object()
        self._timeout = timedelta(seconds=1)


class HoldsWrapper:
    def __init__(self) -> None:
        self._pg = Wrapper()


def test_setting_aside_detaches_the_gloo_group_without_aborting_it():
    manager = HoldsWrapper()
    old = manager._pg._pg
    assert set_aside_process_group(manager)  # type: ignore[arg-type]
    assert manager._pg._pg is None and old is not None
    assert not set_aside_process_group(manager)  # type: ignore[arg-type]


def test_a_lighthouse_address_without_a_scheme_is_unreadable_not_a_crash():
    with pytest.raises(StatusPageUnreadable, match="cannot read"):
        lighthouse_quorum("127.0.0.1:1")


def test_a_real_pending_gloo_allreduce_is_given_up_set_aside_and_the_process_exits_without_waiting_for_it(tmp_path):
    """Two processes on a real torchft Gloo process group; one starts an allreduce the other never joins, so it stays
    pending in Gloo for real (600-s timeout). The watch gives it up, the process group is set aside without an
    abort, a new one is configured and used, and the process exits: none of it waits for the pending allreduce (the
    test's 120-s deadline would expire first)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    worker = str(Path(__file__).resolve().parent / "workers" / "pending_gloo_worker.py")
    silent = subprocess.Popen(
        [sys.executable, worker, "silent", address], stdin=subprocess.PIPE, cwd=REPO, stderr=subprocess.PIPE
    )
    try:
        stuck = subprocess.run(
            [sys.executable, worker, "stuck", address], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert stuck.returncode == 0 and "DONE" in stuck.stdout, stuck.stderr[-3000:]
        assert silent.poll() is None, "the silent rank must still be up, keeping the allreduce pending"
    finally:
        silent.stdin.close()  # type: ignore[union-attr]
        try:
            silent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            silent.kill()
            silent.wait(timeout=10)

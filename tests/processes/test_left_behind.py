"""lightning_ft.step.left_behind: an allreduce the other groups have left behind is given up, not waited out.

Unit tests drive :class:`LeftBehindWatch` with a fake Manager, a fake moved-on signal and a fake clock, and real
torch futures; others run :class:`MovedOnSignal` against a real TCPStore, as members of one quorum do. The
multi-process test (a group stuck in a real job's allreduce, given up and healed) is in
tests/processes/test_failure_injection.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore
from workers.pending_gloo_worker import FakeManager

from lightning_ft.manager.internals import set_aside_process_group
from lightning_ft.manager.moved_on import MovedOn, MovedOnSignal, MovedOnUnknown
from lightning_ft.manager.quorum_store import store_refuses_connections
from lightning_ft.step.left_behind import CollectiveLeftBehindError, LeftBehindWatch

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Signal:
    """The quorum's moved-on marker as the watch sees it (``MovedOnSignal.moved_on``); counts how often it was read."""

    def __init__(self, moved_on: MovedOn | None = None, unreadable: bool = False) -> None:
        self.value = moved_on
        self.unreadable = unreadable
        self.reads = 0

    def __call__(self) -> MovedOn | None:
        self.reads += 1
        if self.unreadable:
            raise MovedOnUnknown("no store client for the current quorum")
        return self.value


def make_watch(signal: Signal, manager: FakeManager | None = None) -> tuple[LeftBehindWatch, Clock]:
    clock = Clock()
    watch = LeftBehindWatch(manager or FakeManager(), signal, clock=clock)
    return watch, clock


def doubled(done: torch.futures.Future[Any]) -> torch.Tensor:
    return done.value()[0] * 2


def test_an_allreduce_that_completes_reaches_ddp_through_the_callback_and_the_marker_is_never_read():
    signal = Signal(MovedOn(9))
    watch, clock = make_watch(signal)
    done: torch.futures.Future[Any] = torch.futures.Future()
    result = watch.track(done, torch.ones(2), doubled)
    clock.now += 0.5
    watch.check()  # younger than check_after: nothing to ask
    done.set_result([torch.full((2,), 3.0)])
    clock.now += 5
    watch.check()  # nothing pending any more
    watch.shutdown()
    assert torch.equal(result.wait(), torch.full((2,), 6.0))
    assert signal.reads == 0 and not watch.take_left_behind()


def test_a_pending_allreduce_is_kept_while_no_member_has_moved_on():
    signal = Signal(None)
    manager = FakeManager(quorum_id=3)
    watch, clock = make_watch(signal, manager)
    result = watch.track(torch.futures.Future(), torch.ones(2), doubled)
    clock.now += 1.5
    watch.check()
    watch.shutdown()
    assert signal.reads == 1 and not result.done() and manager.reported == []


def test_an_allreduce_left_behind_is_given_up_with_the_error_reported_first_and_its_late_end_ignored():
    signal = Signal(MovedOn(4))
    manager = FakeManager(quorum_id=3)
    watch, clock = make_watch(signal, manager)
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


def test_an_unreadable_marker_leaves_the_allreduce_to_the_collective_timeout(caplog):
    signal = Signal(unreadable=True)
    manager = FakeManager()
    watch, clock = make_watch(signal, manager)
    result = watch.track(torch.futures.Future(), torch.ones(1), doubled)
    for _ in range(3):
        clock.now += 1.0
        watch.check()
    watch.shutdown()
    assert signal.reads == 3 and not result.done() and manager.reported == []
    warnings = [r for r in caplog.records if "cannot tell" in r.getMessage()]
    assert len(warnings) == 1 and "FTStrategy(timeout=...)" in warnings[0].getMessage()


def test_a_store_gone_with_its_primary_gives_the_allreduce_up_too():
    manager = FakeManager(quorum_id=3)
    watch, clock = make_watch(Signal(MovedOn(None)), manager)
    result = watch.track(torch.futures.Future(), torch.ones(1), doubled)
    clock.now += 1.5
    watch.check()
    watch.shutdown()
    assert result.done() and "store is gone" in str(manager.reported[0])


def test_the_watchdog_thread_gives_up_on_its_own():
    """The real thread, real clock: an allreduce pending past check_after after a member moved on is given up."""
    manager = FakeManager(quorum_id=0)
    watch = LeftBehindWatch(manager, Signal(MovedOn(1)), check_after=0.05, interval=0.05)
    result = watch.track(torch.futures.Future(), torch.ones(1), doubled)
    try:
        result.wait()  # returns once the watchdog completes it; the test's timeout bounds it
    finally:
        watch.shutdown()
    assert isinstance(manager.reported[0], CollectiveLeftBehindError)


def quorum_address(store: TCPStore, quorum_id: int, group_rank: int = 0) -> str:
    """What torchft's Manager gives the process group: ``<primary's store>/torchft/<quorum id>/<group rank>``."""
    return f"127.0.0.1:{store.port}/torchft/{quorum_id}/{group_rank}"


def test_a_member_that_reconfigures_for_a_newer_quorum_marks_the_old_one_for_those_still_in_it():
    """Two members of quorum 3 on a real TCPStore (the primary's); one moves on to quorum 4: the other reads it."""
    primary = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    moving, staying, elsewhere = (MovedOnSignal(store_refuses_connections) for _ in range(3))
    for member in (moving, staying):
        member.enter(quorum_address(primary, 3), quorum_id=3)
    elsewhere.enter(quorum_address(primary, 3, group_rank=1), quorum_id=3)
    assert staying.moved_on() is None and moving.moved_on() is None
    moving.enter(quorum_address(primary, 4), quorum_id=4)
    assert staying.moved_on() == MovedOn(4)
    assert elsewhere.moved_on() is None, "a marker is per group rank: rank 1's quorum is not left"
    assert moving.moved_on() is None, "the new quorum is not left"


def test_a_quorum_store_gone_with_its_primary_reads_as_moved_on():
    """The store lives in the primary group's rank 0: when that process is gone, connections are refused."""
    serve = (
        "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
        "print(s.port, flush=True); sys.stdin.read()"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", serve],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        member = MovedOnSignal(store_refuses_connections)
        member.enter(f"127.0.0.1:{port}/torchft/3/0", quorum_id=3)
        assert member.moved_on() is None
    finally:
        server.kill()
        server.wait(timeout=30)
    assert member.moved_on() == MovedOn(None)


def test_without_a_store_client_the_marker_is_unknown():
    with pytest.raises(MovedOnUnknown, match="no store client"):
        MovedOnSignal(store_refuses_connections).moved_on()


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


def test_a_real_pending_gloo_allreduce_is_given_up_set_aside_and_the_process_exits_without_waiting_for_it(tmp_path):
    """Two processes on a real torchft Gloo process group; one starts an allreduce the other never joins, so it stays
    pending in Gloo for real (600-s timeout). The watch gives it up, the process group is set aside without an
    abort, a new one is configured and used, and the process exits: none of it waits for the pending allreduce (the
    test's 120-s deadline would expire first)."""
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

"""lightning_ft.process_group.left_behind and .arrival: a collective the other groups have left behind is given up,
and a quorum member that never arrives gives the quorum up, instead of either being waited out.

Unit tests drive :class:`LeftBehindWatch` with a fake moved-on signal, a fake clock and works with real torch
futures; others run :class:`MovedOnSignal` and the arrival barrier against a real TCPStore, as members of one quorum
do, and a real two-process torchft Gloo process group. The multi-process tests (a group stuck in a real job's
collective on each training path, a quorum member dead before its rendezvous) are in
tests/callbacks/test_failure_injection.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import WORKERS
from torch.distributed import PrefixStore, TCPStore

from lightning_ft.process_group.arrival import QuorumMemberMissingError, arrived_key, wait_for_every_member
from lightning_ft.process_group.left_behind import CollectiveLeftBehindError, LeftBehindWatch
from lightning_ft.process_group.moved_on import MovedOn, MovedOnSignal, MovedOnUnknown
from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo, store_refuses_connections

# The compatibility matrix runs these on every environment (`make compat`).
pytestmark = pytest.mark.compat

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


class BackendWork(dist.Work):
    """A backend operation: its future completes when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future


def make_watch(signal: Signal, quorum_id: int = 3) -> tuple[LeftBehindWatch, Clock]:
    clock = Clock()
    watch = LeftBehindWatch(signal, quorum_id=lambda: quorum_id, clock=clock)
    watch.current_step = lambda: 7
    return watch, clock


def test_an_operation_that_completes_hands_its_result_on_and_the_marker_is_never_read():
    signal = Signal(MovedOn(9))
    watch, clock = make_watch(signal)
    backend = BackendWork()
    work = watch.track(backend)
    clock.now += 0.2
    watch.check()  # younger than check_after: nothing to ask
    backend.future.set_result([torch.full((2,), 3.0)])
    clock.now += 5
    watch.check()  # nothing pending any more
    watch.shutdown()
    assert work.wait() and work.is_completed()
    assert torch.equal(work.get_future().value()[0], torch.full((2,), 3.0))
    assert signal.reads == 0 and not watch.take_left_behind()


def test_an_operation_that_fails_by_itself_hands_its_own_error_on():
    watch, _ = make_watch(Signal(None))
    backend = BackendWork()
    work = watch.track(backend)
    backend.future.set_exception(RuntimeError("Connection reset by peer"))
    watch.shutdown()
    with pytest.raises(RuntimeError, match="Connection reset"):
        work.wait()
    assert not watch.take_left_behind()


def test_a_pending_operation_is_kept_while_no_member_has_moved_on():
    signal = Signal(None)
    watch, clock = make_watch(signal)
    work = watch.track(BackendWork())
    clock.now += 1.5
    watch.check()
    watch.shutdown()
    assert signal.reads == 1 and not work.is_completed()


def test_an_operation_left_behind_fails_with_the_reason_and_its_late_end_is_ignored():
    """What torchft's Manager and the DDP hook wait on fails at once; they report it as the step's error."""
    watch, clock = make_watch(Signal(MovedOn(4)), quorum_id=3)
    backend = BackendWork()
    work = watch.track(backend)
    chained = work.get_future().then(lambda done: done.value())  # as the DDP hook's average is chained
    clock.now += 1.0
    watch.check()
    watch.shutdown()
    with pytest.raises(CollectiveLeftBehindError) as raised:
        work.wait()
    assert "quorum 4" in str(raised.value) and "quorum 3" in str(raised.value) and "heals" in str(raised.value)
    with pytest.raises(RuntimeError, match="CollectiveLeftBehindError"):  # torch wraps a callback's error
        chained.wait()
    assert watch.take_left_behind() and not watch.take_left_behind()
    backend.future.set_result([torch.ones(1)])  # the given-up operation ends by itself, 60 s later: nothing happens
    with pytest.raises(CollectiveLeftBehindError):
        work.get_future().wait()


def test_an_unreadable_marker_leaves_the_operation_to_the_collective_timeout(caplog):
    signal = Signal(unreadable=True)
    watch, clock = make_watch(signal)
    work = watch.track(BackendWork())
    for _ in range(3):
        clock.now += 1.0
        watch.check()
    watch.shutdown()
    assert signal.reads == 3 and not work.is_completed()
    warnings = [r for r in caplog.records if "cannot tell" in r.getMessage()]
    assert len(warnings) == 1 and "FTStrategy(timeout=...)" in warnings[0].getMessage()


def test_a_store_gone_with_its_primary_gives_the_operation_up_too():
    watch, clock = make_watch(Signal(MovedOn(None)))
    work = watch.track(BackendWork())
    clock.now += 1.5
    watch.check()
    watch.shutdown()
    with pytest.raises(CollectiveLeftBehindError, match="store is gone"):
        work.wait()


def test_an_operation_without_a_future_is_handed_out_as_it_is():
    """Gloo's sends and receives (a heal over the process group) have no future: they are not watched, and keep
    their own ``wait(timeout)``."""

    class PointToPoint(dist.Work):
        def get_future(self) -> torch.futures.Future[Any]:
            raise RuntimeError("Work::getFuture not implemented")

    send = PointToPoint()
    watch, _ = make_watch(Signal(MovedOn(9)))
    assert watch.track(send) is send


def test_a_wait_with_a_timeout_times_out_as_the_backends_own_does():
    watch, _ = make_watch(Signal(None))
    work = watch.track(BackendWork())
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not complete within 0:00:00\.2"):
        work.wait(timedelta(seconds=0.2))
    assert time.monotonic() - started < 10
    watch.shutdown()


def test_a_wait_with_a_timeout_returns_once_the_operation_completes_before_or_during_it():
    """The timed wait's event is made by the wait itself: an operation that had completed returns at once, one that
    completes while the wait runs wakes it."""
    watch, _ = make_watch(Signal(None))
    done = BackendWork()
    completed = watch.track(done)
    done.future.set_result([torch.ones(1)])
    assert completed.wait(timedelta(seconds=30))
    later = BackendWork()
    pending = watch.track(later)
    threading.Timer(0.05, lambda: later.future.set_result([torch.ones(1)])).start()
    started = time.monotonic()
    assert pending.wait(timedelta(seconds=30)) and time.monotonic() - started < 10
    watch.shutdown()


def test_the_watchdog_thread_gives_up_on_its_own():
    """The real thread, real clock: an operation pending past check_after after a member moved on is given up."""
    watch = LeftBehindWatch(Signal(MovedOn(1)), quorum_id=lambda: 0, check_after=0.05, interval=0.05)
    work = watch.track(BackendWork())
    try:
        with pytest.raises(CollectiveLeftBehindError):
            work.wait()  # returns once the watchdog fails it; the test's timeout bounds it
    finally:
        watch.shutdown()


def test_an_operation_that_fails_here_marks_its_quorum_abandoned_once_from_the_watchdog():
    """A peer died in the collective and closed the connection: this member's operation fails. Another member may
    still wait in the same collective on a send that is lost; the abandoned marker is what releases it."""
    abandoned: list[int | None] = []
    watch = LeftBehindWatch(Signal(None), abandon=abandoned.append, quorum_id=lambda: 3)
    first, second, third = BackendWork(), BackendWork(), BackendWork()
    works = [watch.track(backend) for backend in (first, second, third)]
    third.future.set_result([torch.ones(1)])
    assert abandoned == [], "an operation that completes marks nothing"
    first.future.set_exception(RuntimeError("Connection closed by peer"))
    second.future.set_exception(RuntimeError("Connection closed by peer"))
    try:
        deadline = time.monotonic() + 30
        while not abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.mark_abandoned()  # nothing left to mark: once per quorum
    finally:
        watch.shutdown()
    assert abandoned == [3]
    for work in works[:2]:
        with pytest.raises(RuntimeError, match="closed by peer"):
            work.wait()


def test_an_abandoned_marker_gives_a_pending_operation_up():
    watch, clock = make_watch(Signal(MovedOn(None, abandoned=True)))
    work = watch.track(BackendWork())
    clock.now += 0.6
    watch.check()
    watch.shutdown()
    with pytest.raises(CollectiveLeftBehindError, match="abandoned it"):
        work.wait()


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


def test_a_member_whose_collective_failed_marks_the_quorum_abandoned_for_those_still_in_it():
    """On a real TCPStore: the member whose operation failed marks quorum 3 abandoned; the one still in it reads that.
    A marker already there (another member moved on) is kept, and a quorum this member has left is not marked."""
    primary = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    failed, staying = (MovedOnSignal(store_refuses_connections) for _ in range(2))
    for member in (failed, staying):
        member.enter(quorum_address(primary, 3), quorum_id=3)
    failed.abandon(2)  # an older quorum's late failure: not the current one
    assert staying.moved_on() is None
    failed.abandon(3)
    assert staying.moved_on() == MovedOn(None, abandoned=True)
    for member in (failed, staying):
        member.enter(quorum_address(primary, 5), quorum_id=5)
    staying.enter(quorum_address(primary, 6), quorum_id=6)  # moved on first: its marker says so
    failed.abandon(5)
    assert failed.moved_on() == MovedOn(6), "a moved-on marker is not overwritten"


@pytest.mark.multiprocess
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


def test_a_process_group_with_an_operation_given_up_is_set_aside_not_aborted():
    """``abort`` (the failed step's, or the next reconfiguration's) sets the Gloo group aside once an operation of it
    was given up, and aborts as torchft does otherwise."""
    pg = StoreCheckedProcessGroupGloo()
    pg.__dict__["left_behind_watch"] = LeftBehindWatch(Signal(MovedOn(2)), check_after=0.0)
    held = pg._pg = object()
    pg.left_behind_watch.track(BackendWork())
    pg.left_behind_watch.check()
    pg.abort()
    assert pg._pg is None and held is not None
    assert not pg.set_aside_if_left_behind(), "once per give-up"


def members_of_one_quorum(world_size: int, arrive: list[int], grace: float = 0.5) -> dict[int, BaseException | None]:
    """Members ``arrive`` of a ``world_size`` quorum, each in its own thread on one real TCPStore (the primary's),
    each under the process group's prefix as torchft gives it; returns what each one's wait ended with.

    The members' grace runs on a clock that starts once every member in ``arrive`` has announced itself: on a busy
    machine a thread can start later than the grace, which would make an arriving member look missing. Under test
    is who the members find missing, and that they give the quorum up; not how fast threads start."""
    primary = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    announced = PrefixStore("torchft/5/0", primary)
    reading = threading.Lock()
    every_arrival_at: list[float] = []
    outcome: dict[int, BaseException | None] = {}

    def since_every_arrival() -> float:
        """Seconds since the last member of ``arrive`` announced itself; 0 until then."""
        with reading:
            if not every_arrival_at and announced.check([arrived_key(rank) for rank in arrive]):
                every_arrival_at.append(time.monotonic())
        return time.monotonic() - every_arrival_at[0] if every_arrival_at else 0.0

    def member(rank: int) -> None:
        store = PrefixStore("torchft/5/0", TCPStore("127.0.0.1", primary.port, is_master=False))
        try:
            wait_for_every_member(store, rank, world_size, quorum_id=5, grace=grace, clock=since_every_arrival)
            outcome[rank] = None
        except BaseException as error:  # the outcome is what is asserted
            outcome[rank] = error

    threads = [threading.Thread(target=member, args=(rank,)) for rank in arrive]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcome


def test_every_member_arrives_and_the_rendezvous_goes_ahead():
    assert members_of_one_quorum(3, [0, 1, 2]) == {0: None, 1: None, 2: None}


def test_a_member_that_never_arrives_gives_the_quorum_up_for_everyone_within_the_grace():
    started = time.monotonic()
    outcome = members_of_one_quorum(3, [0, 1], grace=0.5)
    assert time.monotonic() - started < 10, "the members must not wait for a rendezvous timeout"
    for rank in (0, 1):
        assert isinstance(outcome[rank], QuorumMemberMissingError), outcome
        assert "replica rank(s) [2] of quorum 5" in str(outcome[rank])


def test_a_member_arriving_after_the_quorum_was_given_up_does_not_enter_it():
    """The decision is one per quorum: the late member follows it instead of entering a rendezvous alone."""
    primary = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    early = PrefixStore("torchft/5/0", TCPStore("127.0.0.1", primary.port, is_master=False))
    with pytest.raises(QuorumMemberMissingError):
        wait_for_every_member(early, 0, 2, quorum_id=5, grace=0.1)
    late = PrefixStore("torchft/5/0", TCPStore("127.0.0.1", primary.port, is_master=False))
    with pytest.raises(QuorumMemberMissingError, match=r"replica rank\(s\) \[1\]"):
        wait_for_every_member(late, 1, 2, quorum_id=5, grace=5.0)


@pytest.mark.multiprocess
def test_a_real_pending_gloo_allreduce_is_given_up_set_aside_and_the_process_exits_without_waiting_for_it(tmp_path):
    """Two processes on lightning-ft's Gloo process group; one starts an allreduce the other never joins, so it
    stays pending in Gloo for real (600-s timeout). The process group's watch gives it up, the next configure sets
    the group aside without an abort, a new one is configured and used, and the process exits: none of it waits
    for the pending allreduce (the test's 120-s deadline would expire first)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    worker = str(WORKERS / "pending_gloo_worker.py")
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

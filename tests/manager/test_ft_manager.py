"""FTManager's additions to torchft's Manager: quorum observers told once per quorum, the quorum id, heal vetting.

The Manager is built without its servers (``__new__``) and given the attributes that torchft's quorum thread sets
when a quorum completes, so that ``wait_quorum`` runs torchft's own code on a completed quorum future.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from lightning_ft.manager import FTManager, QuorumSeen


class Recorder:
    def __init__(self) -> None:
        self.waits: list[float] = []
        self.quorums: list[QuorumSeen] = []

    def quorum_waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def quorum_formed(self, quorum: QuorumSeen) -> None:
        self.quorums.append(quorum)


def completed_quorum(manager: FTManager, quorum_id: int, participants: int, replica_rank: int | None) -> None:
    """What torchft's quorum thread leaves behind when a quorum has formed."""
    done: Future[None] = Future()
    done.set_result(None)
    manager._quorum_future = done
    manager._quorum_id = quorum_id
    manager._participating_replica_world_size = participants
    manager._participating_replica_rank = replica_rank


def bare_manager() -> FTManager:
    manager = FTManager.__new__(FTManager)
    manager._heal_checks, manager._vetted = {}, None
    manager._quorum_observers, manager._observed_quorum = [], None
    manager._healing, manager._quorum_id = False, -1
    return manager


def test_observers_hear_each_quorums_wait_and_the_quorum_once(monkeypatch):
    """The first wait for a quorum is timed and reported; the later ones of the same step (every allreduce and
    num_participants(), the vote) find it done and known, take no time and tell the observers nothing."""
    manager, recorder = bare_manager(), Recorder()
    manager.add_quorum_observer(recorder)
    ticks = iter(range(0, 1000, 2))  # every reading of the clock is 2 s after the last: each wait lasts 2 s
    monkeypatch.setattr("lightning_ft.manager.ft_manager.monotonic", lambda: float(next(ticks)))
    assert manager.quorum_id() == -1  # before the first quorum
    completed_quorum(manager, quorum_id=4, participants=2, replica_rank=1)
    for _ in range(3):  # torchft waits on the same quorum for every allreduce and num_participants()
        manager.wait_quorum()
    assert recorder.waits == [2.0], "the first wait is timed from its start to its end, the others take none"
    assert recorder.quorums == [QuorumSeen(quorum_id=4, participants=2, replica_rank=1)]
    assert manager.quorum_id() == 4
    completed_quorum(manager, quorum_id=5, participants=1, replica_rank=None)
    manager.wait_quorum()
    assert recorder.waits == [2.0, 2.0]
    assert recorder.quorums[-1] == QuorumSeen(quorum_id=5, participants=1, replica_rank=None)
    assert len(recorder.quorums) == 2


def test_a_later_wait_for_a_known_quorum_still_vets_the_heal():
    """The short way of a known quorum's later waits keeps the heal's check: a state that must not be loaded stops
    the replica at whichever wait comes first after it was received."""
    manager = bare_manager()
    completed_quorum(manager, quorum_id=4, participants=2, replica_rank=1)
    manager.wait_quorum()
    checked: list[object] = []
    manager.register_heal_check("user", checked.append)
    manager._healing, manager._pending_state_dict = True, {"user": {"user": "state"}}
    manager.wait_quorum()
    assert checked == ["state"]


def test_a_failed_wait_is_timed_and_reports_no_quorum():
    manager, recorder = bare_manager(), Recorder()
    manager.add_quorum_observer(recorder)
    failed: Future[None] = Future()
    failed.set_exception(TimeoutError("no quorum"))
    manager._quorum_future = failed
    with pytest.raises(TimeoutError, match="no quorum"):
        manager.wait_quorum()
    assert len(recorder.waits) == 1 and recorder.quorums == []


def test_a_received_state_is_vetted_as_soon_as_the_quorum_is_known():
    manager = bare_manager()
    seen: list[object] = []

    def refuse(state: object) -> None:
        seen.append(state)
        raise ValueError("parameter net.weight: shape (4, 4) here, (8, 4) in the peer's state")

    manager.register_heal_check("model", refuse)
    completed_quorum(manager, quorum_id=1, participants=2, replica_rank=None)
    manager._healing = True
    manager._pending_state_dict = {"user": {"model": "peer state"}}
    with pytest.raises(ValueError, match=r"net\.weight"):
        manager.wait_quorum()
    assert seen == ["peer state"]


def test_a_known_quorum_skips_torchft_s_profiler_range_unless_a_profiler_runs(monkeypatch):
    """torchft's ``wait_quorum`` is ``_quorum_future.result()`` inside a ``record_function`` range (two torch ops per
    call, several calls per step): a quorum already known is taken without it, but a running profiler still gets
    the range, and a quorum still forming is waited for by torchft."""
    import torch
    from torchft import Manager

    calls: list[str] = []
    torchft_wait = Manager.wait_quorum
    monkeypatch.setattr(Manager, "wait_quorum", lambda self: (calls.append("torchft"), torchft_wait(self))[1])
    manager = bare_manager()
    completed_quorum(manager, quorum_id=2, participants=2, replica_rank=0)
    for _ in range(3):
        manager.wait_quorum()
    assert calls == []  # the known quorum, three times, without the range
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        manager.wait_quorum()
    assert calls == ["torchft"]
    assert "torchft::manager::wait_quorum" in {event.name for event in profile.events()}

    forming: Future[None] = Future()
    manager._quorum_future = forming
    monkeypatch.setattr(Manager, "wait_quorum", lambda self: (calls.append("torchft"), forming.set_result(None)))
    manager.wait_quorum()
    assert calls == ["torchft", "torchft"]

    failed: Future[None] = Future()
    failed.set_exception(TimeoutError("no quorum"))
    manager._quorum_future = failed
    with pytest.raises(TimeoutError, match="no quorum"):  # a failed quorum raises torchft's error without the range too
        manager.wait_quorum()
    assert calls == ["torchft", "torchft"]

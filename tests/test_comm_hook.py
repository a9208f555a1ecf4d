"""The cross-group comm hook survives a failed allreduce, and refuses to run outside a quorum."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lightning_ft.comm import FTCommState, ft_allreduce_hook
from lightning_ft.commit import NonFiniteGradientError, QuorumNotStartedError, StepProtocol


class FailedWork:
    """What torchft returns when the peer died mid-allreduce: ``wait()`` reports the error and returns False,
    and the future chain the stock torchft hook asserts on was never built."""

    def wait(self) -> bool:
        return False

    def get_future(self) -> None:
        raise AssertionError("the hook must not reach into the failed work's future")


@dataclass
class FakeManager:
    errors: list[str] = field(default_factory=list)

    def allreduce(self, tensor: torch.Tensor) -> FailedWork:
        self.errors.append("allreduce failed")
        return FailedWork()


class Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_hook_returns_a_completed_future_when_the_cross_group_allreduce_fails():
    manager = FakeManager()
    buffer = torch.ones(4)
    future = ft_allreduce_hook(FTCommState(manager=manager, group=None, group_world_size=1), Bucket(buffer))
    assert future.done()
    assert future.value() is buffer
    assert manager.errors == ["allreduce failed"]


def test_hook_refuses_gradients_without_a_quorum():
    protocol = StepProtocol(manager=FakeManager())  # type: ignore[arg-type]
    state = FTCommState(manager=FakeManager(), group=None, group_world_size=1, before_allreduce=protocol.require_quorum)
    with pytest.raises(QuorumNotStartedError, match="QuorumCallback"):
        ft_allreduce_hook(state, Bucket(torch.ones(2)))


class FailingProcessGroupWork:
    """The process group's own work of an allreduce whose peer died: its future completes with the error."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


@dataclass
class ManagedWork:
    _work: FailingProcessGroupWork


@dataclass
class SwallowingManager:
    """torchft's Manager as far as the hook sees it: ``wrap_future`` completes with ``default`` on error and reports
    it (as ``torchft.Manager.wrap_future`` does)."""

    participants: int = 2
    errors: list[BaseException] = field(default_factory=list)
    work: ManagedWork = field(default_factory=lambda: ManagedWork(FailingProcessGroupWork()))

    def allreduce(self, tensor: torch.Tensor) -> ManagedWork:
        return self.work

    def num_participants(self) -> int:
        return self.participants

    def report_error(self, error: BaseException) -> None:
        self.errors.append(error)

    def wrap_future(self, future: torch.futures.Future, default: torch.Tensor) -> torch.futures.Future:
        def swallow(done: torch.futures.Future) -> torch.Tensor:
            try:
                return done.value()
            except Exception as error:
                self.report_error(error)
                return default

        return future.then(swallow)


def test_hook_returns_before_the_allreduce_completes_and_averages_when_it_does():
    manager = SwallowingManager(participants=2)
    state = FTCommState(manager=manager, group=None, group_world_size=1)
    buffer = torch.full((4,), 6.0)
    future = ft_allreduce_hook(state, Bucket(buffer))
    assert not future.done()  # DDP overlaps it with the rest of the backward pass
    manager.work._work.future.set_result([buffer])
    assert torch.equal(future.wait(), torch.full((4,), 3.0))
    assert [float(s) for s in state.take_bucket_sums()] == [12.0]
    assert state.take_bucket_sums() == []


def test_hook_future_completes_without_error_when_the_peer_dies_mid_allreduce():
    manager = SwallowingManager()
    state = FTCommState(manager=manager, group=None, group_world_size=1)
    buffer = torch.ones(4)
    future = ft_allreduce_hook(state, Bucket(buffer))
    manager.work._work.future.set_exception(RuntimeError("Connection reset by peer"))
    assert future.wait() is buffer  # no exception reaches DDP: the survivor carries on
    assert len(manager.errors) == 1 and "Connection reset by peer" in str(manager.errors[0])


def test_a_healing_group_reads_the_peer_state_once_and_exactly():
    """The HTTP heal's loader (every storage read straight into its tensor) gives back exactly what was sent."""
    import io

    from torch.distributed._serialization import _streaming_save

    from lightning_ft.http_transport import streaming_load_once

    matrix = torch.randn(7, 5)
    state = {
        "weights": torch.randn(300, 17),
        "column": matrix[:, 2],  # a view: its storage is the whole matrix
        "matrix": matrix,
        "bf16": torch.randn(9).to(torch.bfloat16),
        "empty": torch.empty(0),
        "counters": {"step": 12, "name": "g0"},
    }
    stream = io.BytesIO()
    _streaming_save(state, stream)
    stream.seek(0)
    received = streaming_load_once(stream)
    for key in ("weights", "column", "matrix", "bf16", "empty"):
        assert received[key].dtype == state[key].dtype and torch.equal(received[key], state[key]), key
    assert received["counters"] == state["counters"]
    received["column"].fill_(0)  # shares its storage with the received matrix, as it did with the sent one
    assert torch.equal(received["matrix"][:, 2], torch.zeros(7))


def test_buckets_are_not_summed_when_the_non_finite_guard_is_off():
    manager = SwallowingManager(participants=2)
    state = FTCommState(manager=manager, group=None, group_world_size=1, sum_buckets=False)
    future = ft_allreduce_hook(state, Bucket(torch.full((4,), 6.0)))
    manager.work._work.future.set_result([torch.full((4,), 6.0)])
    future.wait()
    assert state.take_bucket_sums() == []


class VotingManager:
    """A Manager that records what happens around the commit vote; ``error`` is what ``errored()`` reports."""

    def __init__(self, error: Exception | None) -> None:
        from torchft.manager import ExceptionWithTraceback

        self._error = ExceptionWithTraceback(error) if error is not None else None
        self.calls: list[str] = []
        self._pg = self

    def start_quorum(self) -> None:
        self.calls.append("quorum")

    def errored(self):
        return self._error

    def abort(self) -> None:
        self.calls.append("abort")

    def should_commit(self) -> bool:
        self.calls.append("vote")
        return self._error is None

    def current_step(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("error", "calls"),
    [
        pytest.param(None, ["quorum", "vote"], id="no-error"),
        pytest.param(RuntimeError("Connection reset by peer"), ["quorum", "abort", "vote"], id="failed-collective"),
        pytest.param(NonFiniteGradientError(0), ["quorum", "vote"], id="non-finite-gradient"),
    ],
)
def test_a_failed_collective_aborts_the_process_group_before_the_vote(error, calls):
    """So that a peer still waiting on this replica in the same collective fails now, not when this replica
    reconfigures after the lighthouse's join timeout (see StepProtocol._abort_failed_process_group)."""
    manager = VotingManager(error)
    protocol = StepProtocol(manager=manager)  # type: ignore[arg-type]
    protocol.open_quorum()
    assert protocol.commit() is (error is None)
    assert manager.calls == calls

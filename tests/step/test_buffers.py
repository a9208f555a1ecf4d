"""Buffers across replica groups (lightning_ft.step.buffers): the change of every buffer since the job last agreed is
averaged at each vote; a rejected step returns to the agreed buffers; a healing peer is sent the agreed ones.

Replicas are threads here, each with its own model and a fake Manager whose process group sums over the threads
(a barrier per collective), so the arithmetic is the real one. The multi-process kill test of a BatchNorm model is
``tests/strategy/test_your_code.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_ft.step.buffers import ModelBuffers, synced_buffers
from lightning_ft.step.protocol import StepProtocol


class ThreadSumGroup:
    """An allreduce(SUM) over ``size`` threads: each call waits for every thread's tensor, then all get the sum."""

    def __init__(self, size: int, fail: bool = False) -> None:
        self.size, self.fail = size, fail
        self._barrier = threading.Barrier(size, timeout=30)
        self._tensors: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> _Done:
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        with self._lock:
            self._tensors[threading.get_ident()] = tensors[0]
        self._barrier.wait()
        total = sum(tensor.clone() for tensor in self._tensors.values())  # the same order in every thread
        self._barrier.wait()
        tensors[0].copy_(total)
        self._barrier.wait()
        return _Done(tensors)


class _Done:
    def __init__(self, value: object) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result(value)

    def get_future(self) -> torch.futures.Future:
        return self.future


class FakeManager:
    """torchft's Manager as the buffers and the protocol use it."""

    def __init__(self, group: ThreadSumGroup, participants: int, participating: bool = True) -> None:
        self._pg = group
        self.participants, self.participating = participants, participating
        self.error: Exception | None = None
        self.decision = True
        self.on_vote: Callable[[], None] = lambda: None

    def errored(self):
        from torchft.manager import ExceptionWithTraceback

        return ExceptionWithTraceback(self.error) if self.error is not None else None

    def num_participants(self) -> int:
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, error: Exception) -> None:
        self.error = self.error or error

    def wrap_future(self, future, default):
        return future

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return 0

    def should_commit(self) -> bool:
        self.on_vote()
        return self.decision and self.error is None


def batchnorm_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model.register_buffer("constant", torch.full((3,), 0.1))  # nobody changes it
    return model


def run_replicas(count: int, step: Callable[[int], object]) -> list[object]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(step, range(count)))


def test_every_replica_ends_a_committed_step_with_the_committed_buffers_plus_the_mean_change():
    """3 replicas, each a forward pass on its own batch: afterwards every replica holds bit-identical buffers, the
    running statistics are the committed ones plus the mean of the three changes, ``num_batches_tracked`` counts the
    one forward pass, and a buffer that nobody changed is bit-for-bit what it was (an average of three equal floats
    would not always be)."""
    group = ThreadSumGroup(3)
    models = [batchnorm_model(seed=0) for _ in range(3)]
    batches = [torch.randn(16, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    alone = [batchnorm_model(seed=0) for _ in range(3)]
    for model, batch in zip(alone, batches, strict=True):
        model(batch)  # what each replica's own forward pass makes of the running statistics

    def step(index: int) -> dict[str, torch.Tensor]:
        manager = FakeManager(group, participants=3)
        protocol = StepProtocol(manager, buffers=ModelBuffers(models[index], manager))  # type: ignore[arg-type]
        protocol.open_quorum()
        models[index](batches[index])
        assert protocol.commit()
        return {name: tensor.clone() for name, tensor in models[index].named_buffers()}

    results = run_replicas(3, step)
    for other in results[1:]:
        for name, tensor in results[0].items():
            assert torch.equal(tensor, other[name]), name
    before = batchnorm_model(seed=0)
    for name in ("1.running_mean", "1.running_var"):
        own = [dict(model.named_buffers())[name] for model in alone]
        start = dict(before.named_buffers())[name]
        expected = (start.double() + sum(o.double() - start.double() for o in own) / 3).float()
        assert torch.equal(results[0][name], expected), name
        assert not torch.equal(results[0][name], own[0]), "the replica kept its own statistics"
    assert int(results[0]["1.num_batches_tracked"]) == 1
    assert torch.equal(results[0]["constant"], torch.full((3,), 0.1))


def test_a_step_that_does_not_commit_returns_every_buffer_to_the_committed_ones():
    group = ThreadSumGroup(1)
    model = batchnorm_model(seed=0)
    committed = {name: tensor.clone() for name, tensor in model.named_buffers()}
    manager = FakeManager(group, participants=1)
    manager.decision = False
    protocol = StepProtocol(manager, buffers=ModelBuffers(model, manager))  # type: ignore[arg-type]
    protocol.open_quorum()
    model(torch.randn(16, 4))
    assert not protocol.commit()
    for name, tensor in model.named_buffers():
        assert torch.equal(tensor, committed[name]), name


def test_a_failed_average_reports_the_error_and_the_step_changes_no_buffer():
    model = batchnorm_model(seed=0)
    committed = {name: tensor.clone() for name, tensor in model.named_buffers()}
    manager = FakeManager(ThreadSumGroup(1, fail=True), participants=2)
    protocol = StepProtocol(manager, buffers=ModelBuffers(model, manager))  # type: ignore[arg-type]
    protocol.open_quorum()
    model(torch.randn(16, 4))
    assert not protocol.commit()
    assert manager.error is not None and "Connection closed" in str(manager.error)
    for name, tensor in model.named_buffers():
        assert torch.equal(tensor, committed[name]), name


def test_a_replica_that_heals_in_the_vote_contributes_nothing_and_ends_with_its_peer_s_buffers():
    """The healing replica's own forward pass ran on stale weights: its change is not averaged in. Its vote loads the
    peer's committed buffers (what the peer's ``committed_state`` sends, not the live ones its forward pass has
    changed), and the settled result equals the peer's."""
    group = ThreadSumGroup(2)
    peer, healer = batchnorm_model(seed=0), batchnorm_model(seed=0)
    with torch.no_grad():
        healer[1].running_mean.fill_(7.0)  # a stale replica
    peer_buffers: list[ModelBuffers] = []
    sent: list[dict[str, torch.Tensor]] = []
    ready = threading.Event()

    def step(index: int) -> dict[str, torch.Tensor]:
        model = (peer, healer)[index]
        manager = FakeManager(group, participants=1, participating=index == 0)
        buffers = ModelBuffers(model, manager)
        protocol = StepProtocol(manager, buffers=buffers)  # type: ignore[arg-type]
        protocol.open_quorum()
        if index == 0:
            peer_buffers.append(buffers)
            model(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)))
            sent.append({k: v.clone() for k, v in buffers.committed_state().items()})  # after its forward pass
            ready.set()
        else:
            model(torch.randn(16, 4, generator=torch.Generator().manual_seed(2)))
            assert ready.wait(30)

            def heal() -> None:  # what StateTransferCallback's load does
                model.load_state_dict({**model.state_dict(), **sent[0]})
                buffers.adopt()

            manager.on_vote = heal
        assert protocol.commit()
        return {name: tensor.clone() for name, tensor in model.named_buffers()}

    peer_result, healer_result = run_replicas(2, step)
    assert torch.equal(sent[0]["1.running_mean"], torch.zeros(8)), "the live, changing buffers were sent"
    for name, tensor in peer_result.items():
        assert torch.equal(tensor, healer_result[name]), name


def test_group_ranks_sum_inside_the_group_first_and_divide_by_every_process():
    """A group of 2 processes: the changes are summed inside the group, then across groups, and divided by group size
    times participants, so every process of the job ends with the same buffers."""
    model = torch.nn.Module()
    model.register_buffer("counter", torch.zeros(2))
    manager = FakeManager(ThreadSumGroup(1), participants=1)
    buffers = ModelBuffers(model, manager, group_size=2, group_sum=lambda t: t.mul_(2))  # type: ignore[arg-type]
    buffers.begin_step()
    model.counter += torch.tensor([1.0, 3.0])
    buffers.average()
    buffers.settle(True)
    assert torch.equal(model.counter, torch.tensor([1.0, 3.0]))


def test_only_floating_point_and_integer_buffers_are_averaged():
    model = batchnorm_model(seed=0)
    model.register_buffer("mask", torch.ones(2, dtype=torch.bool))
    names = [name for name, _, _ in synced_buffers(model)]
    assert names == ["constant", "1.running_mean", "1.running_var", "1.num_batches_tracked"]


@pytest.mark.parametrize("committed", [True, False])
def test_a_semi_synchronous_sync_that_does_not_commit_leaves_buffers_as_they_are(committed: bool):
    model = torch.nn.Module()
    model.register_buffer("counter", torch.zeros(1))
    manager = FakeManager(ThreadSumGroup(1), participants=1)
    buffers = ModelBuffers(model, manager, restore_on_reject=False)  # type: ignore[arg-type]
    buffers.begin_step()
    model.counter += 2
    buffers.average()
    buffers.settle(committed)
    assert float(model.counter) == 2.0


def test_a_model_without_buffers_costs_nothing_and_heals():
    model = torch.nn.Linear(2, 2)
    manager = FakeManager(ThreadSumGroup(1, fail=True), participants=2)  # any collective would fail the step
    buffers = ModelBuffers(model, manager)  # type: ignore[arg-type]
    buffers.adopt()
    buffers.begin_step()
    buffers.average()
    buffers.settle(True)
    assert manager.error is None
    assert buffers.committed_state() == {}


def test_with_several_optimizers_a_collective_failing_after_the_decision_stops_the_group():
    """Manual optimization: the batch's first optimizer step took the vote (committed); the second optimizer's
    gradient allreduce then failed. Stepping on would leave this replica unlike its peers: the second ``commit()``
    raises, so the group restarts and heals."""
    manager = FakeManager(ThreadSumGroup(1), participants=2)
    protocol = StepProtocol(manager)  # type: ignore[arg-type]
    protocol.open_quorum()
    assert protocol.commit()
    manager.report_error(RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="failed after this batch's commit decision"):
        protocol.commit()


def test_manual_optimization_averages_buffers_at_the_batch_end_with_the_second_forward_pass_s_change():
    """Buffers averaged at the batch end (manual optimization): a forward pass after the vote is part of the step's
    change, and a failure of that average after a positive decision stops the group."""
    model = batchnorm_model(seed=0)
    manager = FakeManager(ThreadSumGroup(1), participants=1)
    protocol = StepProtocol(manager, buffers=ModelBuffers(model, manager, at_batch_end=True))  # type: ignore[arg-type]
    protocol.open_quorum()
    model(torch.randn(16, 4))
    assert protocol.commit()
    model(torch.randn(16, 4))  # after the first optimizer stepped
    protocol.close()
    assert int(model[1].num_batches_tracked) == 2

    failing = FakeManager(ThreadSumGroup(1, fail=True), participants=2)
    protocol = StepProtocol(failing, buffers=ModelBuffers(model, failing, at_batch_end=True))  # type: ignore[arg-type]
    protocol.open_quorum()
    model(torch.randn(16, 4))
    assert protocol.commit()
    with pytest.raises(RuntimeError, match="failed after this batch's commit decision"):
        protocol.close()

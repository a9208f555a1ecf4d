"""Cross-group collectives against a fake pair of Managers: two "groups" in two threads whose allreduce sums their
buffers, so packing, slot order, exactness, fall-backs and section quorums are checked without processes."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from lightning_ft.step.collectives import CrossGroupCollectives


class _Failure:
    def __init__(self, error: Exception) -> None:
        self.original_exception = error


class FakeManager:
    """The parts of ``torchft.Manager`` the collectives use; ``allreduce`` sums over every fake manager of a job."""

    def __init__(self, job: FakeJob, slot: int | None) -> None:
        self.job, self.slot = job, slot
        self.quorums: list[dict[str, Any]] = []
        self.failure: _Failure | None = None
        self.fail_next = 0

    def wait_quorum(self) -> None:
        pass

    def start_quorum(self, **kwargs: Any) -> None:
        self.quorums.append(kwargs)
        self.failure = None

    def num_participants(self) -> int:
        return sum(manager.slot is not None for manager in self.job.managers)

    def participating_rank(self) -> int | None:
        return self.slot

    def errored(self) -> _Failure | None:
        return self.failure

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> Any:
        assert reduce_op == ReduceOp.SUM
        if self.fail_next:
            self.fail_next -= 1
            self.failure = _Failure(RuntimeError("peer died"))
        total = self.job.exchange(tensor.clone())
        if self.failure is None:
            tensor.copy_(total)
        return self

    def wait(self) -> bool:
        return True


class FakeJob:
    def __init__(self, slots: list[int | None]) -> None:
        self.managers = [FakeManager(self, slot) for slot in slots]
        self._barrier = threading.Barrier(len(slots), timeout=10)
        self._buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.exchanged: list[tuple[torch.dtype, int]] = []

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._buffers.append(tensor)
            self.exchanged.append((tensor.dtype, tensor.numel()))
        self._barrier.wait()
        total = torch.stack(self._buffers).sum(dim=0)
        self._barrier.wait()
        with self._lock:
            self._buffers.clear()
        self._barrier.wait()
        return total


class FakeProtocol:
    def __init__(self, quorum_open: bool, sync_in_flight: bool = False) -> None:
        self.quorum_open = quorum_open
        self.sync_in_flight = sync_in_flight
        self.quorums_opened = 1

    @property
    def in_step(self) -> bool:
        return self.quorum_open and not self.sync_in_flight


def run_groups(
    job: FakeJob, work: Any, protocols: list[Any] | None = None, positions: list[tuple[int, ...]] | None = None
) -> list[Any]:
    collectives = [
        CrossGroupCollectives(
            manager,  # type: ignore[arg-type]
            protocols[index] if protocols else None,  # type: ignore[arg-type]
            position=(lambda index=index: positions[index]) if positions else (lambda: ()),
        )
        for index, manager in enumerate(job.managers)
    ]
    for each in collectives:
        each.open_section()
    with ThreadPoolExecutor(len(collectives)) as pool:
        return list(pool.map(lambda pair: work(*pair), enumerate(collectives)))


def test_reduce_sum_mean_max_min_over_groups_is_identical_everywhere():
    job = FakeJob([0, 1])
    values = [torch.tensor([1.5, -2.0]), torch.tensor([0.25, 4.0])]
    for op, expected in (
        ("sum", [1.75, 2.0]),
        ("mean", [0.875, 1.0]),
        (ReduceOp.MAX, [1.5, 4.0]),
        ("min", [0.25, -2.0]),
    ):
        results = run_groups(job, lambda index, c, op=op: c.reduce(values[index].clone(), op))
        for result in results:
            assert torch.equal(result, torch.tensor(expected)), (op, result)


def test_all_gather_of_uneven_tensors_keeps_shapes_dtypes_and_slot_order():
    job = FakeJob([1, 0])  # group 1 holds slot 0
    values = [torch.arange(5, dtype=torch.int32), torch.tensor([7, 8], dtype=torch.int32)]
    results = run_groups(job, lambda index, c: c.all_gather(values[index]))
    for result in results:
        assert [t.tolist() for t in result] == [[7, 8], [0, 1, 2, 3, 4]]
        assert all(t.dtype == torch.int32 for t in result)


def test_a_group_outside_the_quorum_contributes_nothing_and_receives_the_participants_values():
    job = FakeJob([0, None])
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(10 + index)), "sum"))
    assert [r.item() for r in results] == [10.0, 10.0]


def test_boolean_decisions_are_shared():
    job = FakeJob([0, 1])
    assert run_groups(job, lambda index, c: c.decide(index == 0, require_all=True)) == [False, False]
    assert run_groups(job, lambda index, c: c.decide(index == 0, require_all=False)) == [True, True]


def test_sections_get_their_own_shrink_only_quorum_and_retry_after_a_failure():
    job = FakeJob([0, 1])
    for manager in job.managers:
        manager.fail_next = 1
    protocols = [FakeProtocol(quorum_open=False), FakeProtocol(quorum_open=False)]
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum"), protocols)
    assert [r.item() for r in results] == [3.0, 3.0]
    for manager in job.managers:
        assert manager.quorums == [{"allow_heal": False, "shrink_only": True}] * 2


def test_a_section_uses_the_quorum_in_place_and_asks_for_its_own_only_after_a_failure():
    """The groups' last quorum formed and nothing failed on it: the section's collectives run on it, without a
    round trip to the lighthouse (where a restarted group waiting would make a shrink_only quorum leave a survivor
    out). A failure on it makes the retry ask for a section quorum of its own."""
    job = FakeJob([0, 1])
    formed: Future[None] = Future()
    formed.set_result(None)
    for manager in job.managers:
        manager._quorum_future = formed  # type: ignore[attr-defined]
    protocols = [FakeProtocol(quorum_open=False), FakeProtocol(quorum_open=False)]
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum"), protocols)
    assert [r.item() for r in results] == [3.0, 3.0]
    assert all(manager.quorums == [] for manager in job.managers)
    for manager in job.managers:
        manager.fail_next = 1
    for protocol in protocols:
        protocol.quorums_opened += 1  # the next section
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum"), protocols)
    assert [r.item() for r in results] == [3.0, 3.0]
    assert all(manager.quorums == [{"allow_heal": False, "shrink_only": True}] for manager in job.managers)


def test_inside_a_step_a_failure_falls_back_to_the_groups_own_value_without_a_new_quorum(caplog):
    job = FakeJob([0, 1])
    for manager in job.managers:
        manager.fail_next = 1
    protocols = [FakeProtocol(quorum_open=True), FakeProtocol(quorum_open=True)]
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum"), protocols)
    assert [r.item() for r in results] == [1.0, 2.0]
    assert all(manager.quorums == [] for manager in job.managers)
    assert "covers this replica group only" in caplog.text


def test_outside_steps_and_sections_reductions_stay_in_the_group():
    job = FakeJob([0, 1])
    protocols = [FakeProtocol(quorum_open=False), FakeProtocol(quorum_open=False)]

    def work(index: int, collectives: CrossGroupCollectives) -> float:
        collectives.close_section()
        with collectives.group_local():
            pass
        return collectives.reduce(torch.tensor(float(index + 1)), "sum").item()

    assert run_groups(job, work, protocols) == [1.0, 2.0]
    assert all(manager.quorums == [] for manager in job.managers)


def test_inner_steps_overlapping_a_sync_stay_in_the_group_and_sections_use_the_syncs_quorum():
    """Streaming DiLoCo with fragment_sync_delay: the sync's quorum stays open while inner steps train. Their
    collectives stay group-local; a section (validation) in those steps crosses groups on that open quorum, without
    starting a quorum that would reconfigure the process group under the sync's allreduce."""
    job = FakeJob([0, 1])
    protocols = [FakeProtocol(quorum_open=True, sync_in_flight=True) for _ in range(2)]

    def inner_step(index: int, collectives: CrossGroupCollectives) -> float:
        collectives.close_section()
        return collectives.reduce(torch.tensor(float(index + 1)), "sum").item()

    assert run_groups(job, inner_step, protocols) == [1.0, 2.0]
    in_section = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum").item(), protocols)
    assert in_section == [3.0, 3.0]
    assert all(manager.quorums == [] for manager in job.managers)


def test_a_new_step_quorum_ends_the_section():
    protocol = FakeProtocol(quorum_open=False)
    collectives = CrossGroupCollectives(FakeJob([0]).managers[0], protocol)  # type: ignore[arg-type]
    collectives.open_section()
    assert collectives.crosses_groups
    protocol.quorums_opened += 1
    assert not collectives.crosses_groups


@pytest.mark.parametrize("op", ["median", "bogus"])
def test_unknown_reduce_ops_are_refused_with_the_supported_ones_named(op):
    collectives = CrossGroupCollectives(FakeJob([0]).managers[0], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'sum', 'mean', 'max' or 'min'"):
        collectives.reduce(torch.tensor(1.0), op)


def test_a_section_starts_with_a_handshake_of_an_odd_number_of_bytes():
    """Whole floats (a training step's gradients) can never be paired with it."""
    job = FakeJob([0, 1])
    protocols = [FakeProtocol(quorum_open=False), FakeProtocol(quorum_open=False)]
    positions = [(7, 0, 70), (7, 0, 70)]
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(1.0), "sum"), protocols, positions)
    assert [r.item() for r in results] == [2.0, 2.0]
    handshakes = [(dtype, numel) for dtype, numel in job.exchanged if dtype == torch.uint8]
    assert handshakes == [(torch.uint8, 2 * 3 * 8 + 1)] * 2


def test_groups_at_different_positions_do_not_combine_their_values(caplog):
    job = FakeJob([0, 1])
    protocols = [FakeProtocol(quorum_open=False), FakeProtocol(quorum_open=False)]
    positions = [(7, 0, 70), (6, 0, 69)]
    results = run_groups(job, lambda index, c: c.reduce(torch.tensor(float(index + 1)), "sum"), protocols, positions)
    assert [r.item() for r in results] == [1.0, 2.0]
    assert all(len(manager.quorums) == 3 for manager in job.managers)
    assert "3 section quorums in a row failed" in caplog.text
    assert "replica groups are out of step: participant 1 is at [6, 0, 69], expected [7, 0, 70]" in caplog.text


def test_a_section_without_every_group_says_its_values_cover_the_groups_in_it_only(caplog, tmp_path, monkeypatch):
    """Validation with one of three groups dead: the two live groups reduce over their own shards only, and say so
    (a warning and a ``section_partial`` event); with every group there, nothing is said."""
    from lightning_ft_job import events

    monkeypatch.setenv(events.ENV_EVENTS_DIR, str(tmp_path))
    events.configure(replica_group_id=0, group_rank=0)
    job = FakeJob([0, 1])  # the job's third group is not in the quorum
    for manager in job.managers:
        manager.current_step = lambda: 12  # type: ignore[attr-defined]

    def run(expected: int) -> list[Any]:
        collectives = [
            CrossGroupCollectives(manager, FakeProtocol(quorum_open=False), expected_groups=expected)  # type: ignore[arg-type]
            for manager in job.managers
        ]
        for each in collectives:
            each.open_section()
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda c: c.reduce(torch.tensor(1.0), "sum").item(), collectives))

    try:
        assert run(expected=2) == [2.0, 2.0]
        assert "take part" not in caplog.text and not events.read_events(tmp_path)
        assert run(expected=3) == [2.0, 2.0]
    finally:
        monkeypatch.setenv(events.ENV_EVENTS_DIR, "")
        events.configure(replica_group_id=0, group_rank=0)  # the event log off again
    assert caplog.text.count("2 of 3 replica groups take part in this evaluation or epoch end") == 2
    partial = [r for r in events.read_events(tmp_path) if r["event"] == "section_partial"]
    assert [(r["participants"], r["replica_groups"], r["step"]) for r in partial] == [(2, 3, 12)] * 2

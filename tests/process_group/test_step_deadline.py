"""On NCCL a step's cross-group allreduces go straight to the NCCL group and one deadline per step bounds them all,
armed after the last bucket; when it expires, the process group is aborted (what torchft's ``errored()`` reports).

On the CPU the NCCL group is a stand-in with torchft's wrapper's shape (``parent``, ``abort``, ``_timeout``) under a
real DDP model of several buckets; on a GPU the timer is torchft's own, on a real CUDA stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
from helpers import cuda_only, keep_gpu_busy

from lightning_ft.process_group import step_deadline
from lightning_ft.process_group.step_deadline import StepDeadline
from lightning_ft.step.gradient_hooks import FTCommState, _step_deadline, ft_allreduce_hook

pytestmark = pytest.mark.timeout(120)


class RecordingGroup:
    """The NCCL group under torchft's wrapper: completes every allreduce at once, recording it."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> object:
        self.log.append("allreduce")
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(tensors)
        return type("Work", (), {"get_future": lambda self: future})()


class NCCLWrapper:
    """torchft's reconfigurable NCCL process group, as the hook and the deadline see it."""

    def __init__(self, log: list[str]) -> None:
        self.parent = RecordingGroup(log)
        self._timeout = timedelta(seconds=7)
        self.aborted = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> object:
        raise AssertionError("the wrapper's allreduce (a timer around every collective) was used")

    def abort(self) -> None:
        self.aborted += 1


@dataclass
class FakeManager:
    log: list[str] = field(default_factory=list)
    error: BaseException | None = None
    wrapped: int = 0

    def __post_init__(self) -> None:
        self._pg = NCCLWrapper(self.log)

    def errored(self) -> object:
        return self.error

    def num_participants(self) -> int:
        return 2

    def is_participating(self) -> bool:
        return True

    def report_error(self, error: BaseException) -> None:
        self.error = error

    def wrap_future(self, future: object, default: object) -> object:
        self.wrapped += 1
        return future


def record_timers(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> list[tuple[object, timedelta]]:
    """torchft's ``stream_timeout`` as the deadline calls it: each (callback, timeout), and "deadline" in ``log``."""
    armed: list[tuple[object, timedelta]] = []

    def stream_timeout(callback: object, timeout: timedelta) -> None:
        armed.append((callback, timeout))
        log.append("deadline")

    monkeypatch.setattr(step_deadline, "stream_timeout", stream_timeout)
    return armed


def several_bucket_model() -> torch.nn.parallel.DistributedDataParallel:
    import torch.distributed as dist

    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    layers = [torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8)]
    return torch.nn.parallel.DistributedDataParallel(  # FTStrategy's default search: the same buckets every step
        torch.nn.Sequential(*layers), process_group=group, bucket_cap_mb=1, find_unused_parameters=True
    )


def test_each_step_launches_on_the_nccl_group_and_arms_one_deadline_after_its_last_bucket(monkeypatch):
    manager = FakeManager()
    timers = record_timers(monkeypatch, manager.log)
    deadline = _step_deadline(manager)  # type: ignore[arg-type]  # what the hook's installation builds on NCCL
    state = FTCommState(manager=manager, group=None, group_world_size=1, step_deadline=deadline)  # type: ignore[arg-type]
    model = several_bucket_model()
    model.register_comm_hook(state, ft_allreduce_hook)
    for _ in range(3):
        model(torch.randn(3, 64)).sum().backward()
    steps = "".join("A" if entry == "allreduce" else "|" for entry in manager.log).split("|")[:-1]
    assert len(steps) == 3 and len(set(steps)) == 1, manager.log  # each step: its allreduces, then one deadline
    assert len(steps[0]) > 1, "the model must make several buckets, so that a timer per bucket would show"
    assert len(timers) == deadline.armed == 3
    assert manager.wrapped == 0 and manager.error is None  # no Manager timer per bucket either
    callback, timeout = timers[-1]
    assert timeout == timedelta(seconds=7)  # the process group's own timeout, FTStrategy(timeout=...)
    callback()  # the deadline expires: the process group is aborted, as torchft's own timer would
    assert manager._pg.aborted == 1


def test_a_step_that_launched_nothing_arms_no_deadline(monkeypatch):
    manager = FakeManager(error=RuntimeError("an earlier failure"))
    timers = record_timers(monkeypatch, manager.log)
    deadline = StepDeadline(manager._pg, manager._pg._timeout)
    state = FTCommState(manager=manager, group=None, group_world_size=1, step_deadline=deadline)  # type: ignore[arg-type]
    model = several_bucket_model()
    model.register_comm_hook(state, ft_allreduce_hook)
    model(torch.randn(3, 64)).sum().backward()
    assert manager.log == [] and timers == []


def stalled_completion(sleep_s: float) -> torch.futures.Future[torch.Tensor]:
    """A CUDA future completed at once, as NCCL's are at launch, whose events come after a kernel that keeps the
    current stream busy for ``sleep_s`` seconds (0: none)."""
    tensor = torch.ones(4, device="cuda")
    if sleep_s:
        keep_gpu_busy(sleep_s)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[tensor.device])
    future.set_result(tensor.mul_(2))
    return future


def handled_timers(count: int) -> list[str]:
    """Wait until torchft's timeout thread has handled ``count`` more timers: each one's handler, called at its
    deadline, hands its event to the deletion queue after it has (or has not) called back. Drains the device after.

    Returns what was seen as each event arrived (for a failure's message): the seconds since this call, whether the
    event and the current stream had completed by then, and the event's device."""
    from torchft.futures import _TIMEOUT_MANAGER

    started = time.monotonic()
    seen = []
    for _ in range(count):
        event = _TIMEOUT_MANAGER._del_queue.get(timeout=30)  # a gate with a deadline, as torchft's own test waits
        seen.append(
            f"handled after {time.monotonic() - started:.2f} s, event done {event.query()}, stream done "
            f"{torch.cuda.current_stream().query()}, event device {getattr(event, 'device', '?')}"
        )
        del event
    torch.cuda.synchronize()
    return seen


@cuda_only
def test_on_a_gpu_torchfts_stream_timeout_fires_on_a_stalled_stream():
    """The control: torchft's timer alone, on the current stream, behind a kernel that outlasts it."""
    from torchft.futures import stream_timeout

    fired: list[bool] = []
    keep_gpu_busy(3.0)
    stream_timeout(lambda: fired.append(True), timedelta(seconds=0.5))
    seen = handled_timers(1)
    assert fired, seen


@cuda_only
@pytest.mark.parametrize(
    ("sleep_s", "aborts"),
    [(3.0, 1), (0.0, 0)],
    ids=["aborts-when-the-last-collective-has-not-finished", "quiet-when-the-collectives-finish-in-time"],
)
def test_on_a_gpu_the_deadline_times_the_steps_collectives(sleep_s: float, aborts: int):
    """A 0.5-s deadline behind a kernel that outlasts it aborts; behind none, its handler finds the event done."""
    manager = FakeManager()
    manager._pg._timeout = timedelta(seconds=0.5)
    deadline = StepDeadline(manager._pg, manager._pg._timeout)
    deadline.launched(stalled_completion(sleep_s))
    deadline.arm()
    # Where it failed on an H200 (11-30, aborted 0 of 1, the control passing), these say which premise broke.
    assert deadline.armed == 1
    if sleep_s:
        assert not torch.cuda.current_stream().query(), "the stream was no longer busy when the deadline was armed"
    seen = handled_timers(1)
    assert manager._pg.aborted == aborts, seen

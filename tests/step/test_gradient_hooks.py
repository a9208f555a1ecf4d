"""The cross-group comm hook survives a failed allreduce, and refuses to run outside a quorum."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lightning_ft.step.gradient_hooks import FTCommState, ft_allreduce_hook
from lightning_ft.step.protocol import NonFiniteGradientError, QuorumNotStartedError, StepProtocol


class PendingWork:
    """The process group's work of an allreduce: its future completes when the test says so."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


class FakeProcessGroup:
    """torchft's reconfigurable process group as the hook uses it; ``refuse`` makes ``allreduce`` raise at once (a
    process group whose connections are already gone)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.sent: list[torch.Tensor] = []
        self.work = PendingWork()

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> PendingWork:
        if self.refuse:
            raise RuntimeError("Connection closed by peer")
        self.sent.append(tensors[0].clone())
        return self.work


@dataclass
class FakeManager:
    """torchft's Manager as far as the hook sees it."""

    participants: int = 2
    participating: bool = True
    error: BaseException | None = None
    _pg: FakeProcessGroup = field(default_factory=FakeProcessGroup)
    quorum_waits: int = 0
    wrapped: int = 0

    def errored(self):
        from torchft.manager import ExceptionWithTraceback

        return ExceptionWithTraceback(self.error) if self.error is not None else None

    def wait_quorum(self) -> None:
        self.quorum_waits += 1

    def num_participants(self) -> int:
        self.wait_quorum()  # as torchft's does
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, error: BaseException) -> None:
        self.error = error

    def wrap_future(self, future: torch.futures.Future, default: torch.Tensor) -> torch.futures.Future:
        self.wrapped += 1
        return future


class Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return True


def hook_state(manager: FakeManager, **settings) -> FTCommState:
    return FTCommState(manager=manager, group=None, group_world_size=1, **settings)


def test_hook_returns_a_completed_future_when_the_process_group_refuses_the_allreduce():
    manager = FakeManager(_pg=FakeProcessGroup(refuse=True))
    buffer = torch.ones(4)
    future = ft_allreduce_hook(hook_state(manager), Bucket(buffer))
    assert future.done()
    assert future.value() is buffer
    assert "Connection closed" in str(manager.error)


def test_hook_refuses_gradients_without_a_quorum():
    protocol = StepProtocol(manager=FakeManager())  # type: ignore[arg-type]
    state = FTCommState(manager=FakeManager(), group=None, group_world_size=1, before_allreduce=protocol.require_quorum)
    with pytest.raises(QuorumNotStartedError, match="QuorumCallback"):
        ft_allreduce_hook(state, Bucket(torch.ones(2)))


def test_hook_returns_before_the_allreduce_completes_and_averages_when_it_does():
    manager = FakeManager(participants=2)
    state = hook_state(manager)
    buffer = torch.full((4,), 6.0)
    future = ft_allreduce_hook(state, Bucket(buffer))
    assert not future.done()  # DDP overlaps it with the rest of the backward pass
    assert manager.quorum_waits == 1  # the quorum decides who takes part before anything is sent
    manager._pg.work.future.set_result([buffer])
    assert torch.equal(future.wait(), torch.full((4,), 3.0))
    assert state.take_gradient_check()() is True  # the averaged bucket was checked, and was finite
    assert state.take_gradient_check() is None  # once per step
    assert manager.error is None and manager.wrapped == 0


def test_hook_future_completes_without_error_when_the_peer_dies_mid_allreduce():
    manager = FakeManager()
    state = hook_state(manager)
    buffer = torch.ones(4)
    future = ft_allreduce_hook(state, Bucket(buffer))
    manager._pg.work.future.set_exception(RuntimeError("Connection reset by peer"))
    assert future.wait() is buffer  # no exception reaches DDP: the survivor carries on
    assert "Connection reset by peer" in str(manager.error)
    assert state.take_gradient_check() is None  # nothing was averaged: the gate reads the gradients if it must


def test_nothing_is_sent_once_the_step_has_errored():
    manager = FakeManager(error=RuntimeError("an earlier bucket failed"))
    buffer = torch.ones(4)
    future = ft_allreduce_hook(hook_state(manager), Bucket(buffer))
    assert future.done() and future.value() is buffer
    assert manager._pg.sent == [] and manager.quorum_waits == 0


def test_a_group_that_heals_this_step_sends_zeros():
    """With an asynchronous quorum a healing group trains on its old weights; its gradient must not count."""
    manager = FakeManager(participants=2, participating=False)
    future = ft_allreduce_hook(hook_state(manager), Bucket(torch.full((4,), 5.0)))
    assert torch.equal(manager._pg.sent[0], torch.zeros(4))
    manager._pg.work.future.set_result([torch.full((4,), 8.0)])
    future.wait()


def test_a_non_finite_average_is_flagged_until_the_step_takes_the_check():
    manager = FakeManager(participants=2)
    state = hook_state(manager)
    finite, poisoned = torch.full((4,), 6.0), torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    for buffer in (finite, poisoned):
        manager._pg = FakeProcessGroup()
        future = ft_allreduce_hook(state, Bucket(buffer))
        manager._pg.work.future.set_result([buffer])
        future.wait()
    assert torch.equal(finite, torch.full((4,), 3.0))
    assert state.take_gradient_check()() is False  # one of the step's two buckets held a NaN
    manager._pg = FakeProcessGroup()
    future = ft_allreduce_hook(state, Bucket(torch.ones(4)))
    manager._pg.work.future.set_result([torch.ones(4)])
    future.wait()
    assert state.take_gradient_check()() is True  # the next step starts with a clean flag


def test_the_average_multiplies_by_the_reciprocal_as_ddp_does():
    """Every group computes the same bits, whatever its non-finite guard: 1/3 rounded once, then one multiply."""
    manager = FakeManager(participants=3)
    state = hook_state(manager)
    buffer = torch.linspace(-5.0, 7.0, 101)
    expected = buffer * torch.tensor(1.0 / 3)
    future = ft_allreduce_hook(state, Bucket(buffer))
    manager._pg.work.future.set_result([buffer])
    assert torch.equal(future.wait(), expected)


def test_a_healing_group_reads_the_peer_state_once_and_exactly():
    """The HTTP heal's loader (every storage read straight into its tensor) gives back exactly what was sent."""
    import io

    from torch.distributed._serialization import _streaming_save

    from lightning_ft.manager.http_transport import streaming_load_once

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


def _bucket_layouts(model: torch.nn.parallel.DistributedDataParallel, steps: int) -> list[list[list[tuple[int, ...]]]]:
    """The parameters' shapes of each bucket, in launch order, at each of ``steps`` forward and backward passes."""
    seen: list[list[tuple[int, ...]]] = []

    def record(_, bucket):  # no annotations: DDP checks them, and this module's are strings
        seen.append([tuple(p.shape) for p in bucket.parameters()])
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, record)
    layouts = []
    for _ in range(steps):
        seen.clear()
        model(torch.randn(3, 64)).sum().backward()
        layouts.append(list(seen))
    return layouts


def _standalone_gloo_group() -> torch.distributed.ProcessGroup:
    """A one-process Gloo process group of its own, as torchft builds its process groups: no default group, so no
    state shared with other tests of the same process."""
    import torch.distributed as dist

    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def test_without_unused_parameter_search_a_fresh_process_starts_with_the_buckets_its_peers_run():
    """``find_unused_parameters=False``: DDP would rebuild its buckets after a process's first step, so a group
    restarted mid-run would allreduce one bucket against its peers' rebuilt ones; the layout is pinned before the
    first step, and a fresh process's first step uses the layout that a process three steps in uses."""
    from lightning_ft.step.gradient_hooks import pin_bucket_layout

    group = _standalone_gloo_group()

    def pinned() -> torch.nn.parallel.DistributedDataParallel:
        layers = [torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8)]
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(*layers), process_group=group, find_unused_parameters=False, bucket_cap_mb=1
        )
        pin_bucket_layout(model)
        return model

    running = _bucket_layouts(pinned(), steps=3)
    fresh_first_step = _bucket_layouts(pinned(), steps=1)[0]
    assert len(running[0]) > 1, running  # several buckets, so that an order can differ
    assert running[0] == running[1] == running[2] == fresh_first_step


def test_a_model_under_25_mib_crosses_groups_in_one_collective_per_step(monkeypatch):
    """FTStrategy passes DDP an explicit 25-MiB bucket cap: torch's own default caps the first bucket at 1 MiB, which
    splits 2 MB of gradients into two buckets, two cross-group collectives per step (the control below)."""
    from lightning_ft import FTStrategy

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    group = _standalone_gloo_group()
    layers = [torch.nn.Linear(64, 8192), torch.nn.Tanh(), torch.nn.Linear(8192, 8)]  # 2.2 MB of gradients

    def buckets(**ddp_kwargs: object) -> int:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(*layers), process_group=group, **ddp_kwargs
        )
        counts = {len(layout) for layout in _bucket_layouts(model, steps=3)}
        assert len(counts) == 1, counts  # the same layout at every step
        return counts.pop()

    passed_on = FTStrategy()._ddp_kwargs
    assert passed_on["bucket_cap_mb"] == 25
    assert buckets(**passed_on) == 1
    assert buckets(find_unused_parameters=True) == 2  # torch's default cap: the layout FTStrategy no longer uses
    assert FTStrategy(bucket_cap_mb=1)._ddp_kwargs["bucket_cap_mb"] == 1  # a user's own cap wins


def test_a_backward_pass_that_leaves_a_parameter_out_is_named_before_the_vote():
    """``find_unused_parameters=False``: a backward pass that never reached some parameters leaves their buckets
    unreduced; the check the step owner makes before the vote raises, naming them as the model does (DDP lists indices
    among the parameters it reduces: a frozen one, one DDP ignores and a second use of a shared one are not counted).
    A complete backward pass, and a forward pass without one (nothing began to reduce), pass."""
    from lightning_ft.step.unfinished_reduction import UnusedParameterError, check_reduction_finished

    group = _standalone_gloo_group()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.ignored = torch.nn.Linear(4, 4)
            self.first = torch.nn.Linear(4, 4)
            self.shared = self.first  # the same parameters under a second name
            self.last = torch.nn.Linear(4, 1)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.shared(self.ignored(self.frozen(x)))
            return torch.nn.functional.linear(hidden, self.last.weight) if self.skip else self.last(hidden)

    net = Net()
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["ignored.weight"])
    model = torch.nn.parallel.DistributedDataParallel(net, process_group=group, find_unused_parameters=False)
    model(torch.randn(2, 4)).sum().backward()
    check_reduction_finished(model)
    model(torch.randn(2, 4))  # no backward pass: nothing to reduce
    check_reduction_finished(model)
    net.skip = True
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(
        UnusedParameterError, match=r"\(last\.bias\).*find_unused_parameters at its default \(None\) or set it to True"
    ):
        check_reduction_finished(model)


@pytest.mark.parametrize("search", [True, False], ids=["search", "no-search"])
@pytest.mark.parametrize("as_views", [True, False], ids=["views", "copies"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zeroed"])
def test_a_parameter_the_whole_group_left_out_takes_its_buckets_average(
    search: bool, as_views: bool, set_to_none: bool
):
    """A stand-in cross-group hook writes a known average (7) into every bucket; after each backward pass every
    parameter holds it, the last layer's bias too in the steps that leave it out, with and without DDP's search, with
    gradients as views and as copies. A parameter frozen for a step (``requires_grad=False``, as a toggled optimizer
    does) is left as DDP leaves it (``None`` after ``zero_grad()``). Without :meth:`LeftOutParameters.give_average`
    the search leaves the bias ``None`` or zeroed (DDP's "globally unused", which is only the group), and without
    the search the bucket is never reduced: every case fails but one (views of the bucket, zeroed not ``None``,
    where such a gradient is the slot itself, as the module says)."""
    from lightning_ft.step.gradient_hooks import pin_bucket_layout
    from lightning_ft.step.left_out_parameters import LeftOutParameters

    group = _standalone_gloo_group()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.middle = torch.nn.Linear(4, 4)
            self.last = torch.nn.Linear(4, 1)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.middle(self.first(x))
            return torch.nn.functional.linear(hidden, self.last.weight) if self.skip else self.last(hidden)

    net = Net()
    model = torch.nn.parallel.DistributedDataParallel(
        net, process_group=group, find_unused_parameters=search, gradient_as_bucket_view=as_views
    )
    if not search:
        pin_bucket_layout(model)
    left_out = LeftOutParameters(model)

    def stand_in_average(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        left_out.saw(bucket)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer().fill_(7.0))
        return done

    model.register_comm_hook(None, stand_in_average)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for skip, freeze in ((False, False), (True, False), (False, True), (True, True), (False, False)):
        optimizer.zero_grad(set_to_none=set_to_none)
        net.skip = skip
        net.middle.requires_grad_(not freeze)
        model(torch.randn(2, 4)).sum().backward()
        left_out.give_average()
        for name, parameter in net.named_parameters():
            if freeze and name.startswith("middle."):
                assert parameter.grad is None or not set_to_none, f"{name}: frozen, yet {parameter.grad}"
                continue
            assert parameter.grad is not None, name
            assert bool((parameter.grad == 7.0).all()), f"{name}: {parameter.grad}"


def test_ddp_s_own_complaint_names_ft_strategy_s_setting_not_ddp_strategy_s():
    """Where no vote checks first (a semi-synchronous inner step), DDP raises at the next forward pass and Lightning's
    DDPStrategy rewords it to name ``DDPStrategy(find_unused_parameters=True)``; FTStrategy's message names its own
    setting, and Lightning's rewording no longer matches it. Other errors are left as they are."""
    from lightning_ft import FTStrategy

    ddp_says = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    FTStrategy().on_exception(ddp_says)
    assert "FTStrategy(find_unused_parameters=False)" in str(ddp_says) and "set it to True" in str(ddp_says)
    assert "DDPStrategy" not in str(ddp_says)
    other = RuntimeError("something else")
    FTStrategy().on_exception(other)
    assert str(other) == "something else"


def test_the_default_searches_for_unused_parameters_only_where_the_buckets_can_overlap(monkeypatch):
    """``find_unused_parameters=None``: no search for a per-step model whose gradients make one bucket (the search
    buys no overlap there, and a step that leaves a parameter out is completed instead); the search for several
    buckets, other dtypes beside each other, sparse gradients and semi-synchronous inner steps (DDP's alone). A user's
    value wins, and only FTStrategy's own choice keeps torch's note about it off the terminal."""
    from lightning_ft import FTStrategy
    from lightning_ft.step.left_out_parameters import search_for_unused_parameters

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    small = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 8))  # 0.15 MB
    large = torch.nn.Sequential(torch.nn.Linear(4096, 2048))  # 32 MiB
    mixed = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 8).to(torch.float64))
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    kwargs = {"find_unused_parameters": True, "bucket_cap_mb": 25}

    def chosen(model: torch.nn.Module, per_step: bool = True, **settings: object) -> bool:
        return search_for_unused_parameters(model, {**kwargs, **settings}, chosen_by_default=True, per_step=per_step)

    assert not chosen(small)
    assert chosen(small, bucket_cap_mb=0.1)  # two buckets at a smaller cap
    assert chosen(large) and chosen(mixed) and chosen(sparse)
    assert chosen(small, per_step=False)
    assert search_for_unused_parameters(small, kwargs, chosen_by_default=False, per_step=True)  # the user's True
    assert not search_for_unused_parameters(
        large, {**kwargs, "find_unused_parameters": False}, chosen_by_default=False, per_step=True
    )

    strategy = FTStrategy()
    assert strategy._choose_unused_search(small) is small
    assert strategy._ddp_kwargs["find_unused_parameters"] is False and not strategy._torch_note_pending
    strategy._choose_unused_search(large)
    assert strategy._ddp_kwargs["find_unused_parameters"] is True and strategy._torch_note_pending
    explicit = FTStrategy(find_unused_parameters=True)
    explicit._choose_unused_search(small)
    assert explicit._ddp_kwargs["find_unused_parameters"] is True and not explicit._torch_note_pending

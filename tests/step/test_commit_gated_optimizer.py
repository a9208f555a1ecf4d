"""``CommitGatedOptimizer`` (lightning_ft/step/protocol.py) with a fake step protocol in place of a torchft Manager.

Why: the wrapper is where torchft's commit vote meets the real optimizer. Lightning's precision plugin calls
``step(closure)``; the closure (forward, backward, clipping, unscaling) must run exactly once, *before* the vote, since
its gradients are what the replica groups agreed to average; the vote must be taken exactly once per step; the real
optimizer must step only when the vote commits, so that a rejected step leaves parameters and optimizer state exactly
as they were (every group skips it alike). A step whose averaged gradient is not finite is voted against before the
vote, unless a vote was already taken for this batch or the check is off. Everything else is the wrapped optimizer's.

The fake protocol records every call in one ordered log; its vote is ``False`` once it was told to reject, as a
torchft Manager with a reported error votes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_ft.step.gated_optimizer import CommitGatedOptimizer, EvaluatedClosure
from lightning_ft.step.protocol import NonFiniteGradientError

pytestmark = pytest.mark.timeout(60)


class FakeManager:
    def __init__(self, step: int) -> None:
        self.step = step

    def current_step(self) -> int:
        return self.step


class FakeProtocol:
    """What ``CommitGatedOptimizer`` uses of ``StepProtocol``: ``decided``, ``vote_inputs_queued``, ``read_at_vote``,
    ``reject``, ``commit`` and the manager's step. ``log`` is shared with the closure and the optimizer, so that the
    order of events can be checked. As the real protocol does, ``commit`` reads the finite check and the loss it was
    given right before the vote is cast (the real one does so after the vote's device sync,
    ``tests/step/test_host_syncs.py``)."""

    def __init__(self, log: list[str], vote: bool = True, decided: bool = False, step: int = 7) -> None:
        self.log = log
        self.vote = vote
        self._decided = decided
        self.manager = FakeManager(step)
        self.rejections: list[Exception] = []
        self.votes = 0
        self.finite: Callable[[], bool] | None = None
        self.losses: list[torch.Tensor | None] = []

    @property
    def decided(self) -> bool:
        return self._decided

    @property
    def vote_inputs_queued(self) -> bool:  # the real one: queued at the end of the backward pass on a GPU
        return False

    def reject(self, reason: Exception) -> None:
        self.log.append("reject")
        self.rejections.append(reason)

    def read_at_vote(self, finite: Callable[[], bool] | None = None, loss: torch.Tensor | None = None) -> None:
        self.finite = finite
        self.losses.append(loss)

    def commit(self) -> bool:
        finite, self.finite = self.finite, None
        if finite is not None and not finite():
            self.reject(NonFiniteGradientError(self.manager.step))
        self.log.append("vote")
        self.votes += 1
        self._decided = True
        return self.vote and not self.rejections


class Setup:
    """A tiny model, a real Adam optimizer whose ``step`` is logged, a fake protocol and the wrapper around them."""

    def __init__(
        self,
        vote: bool = True,
        decided: bool = False,
        skip_non_finite: bool = True,
        gradient_check: Callable[[], Callable[[], bool] | None] | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.log: list[str] = []
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)
        real_step = self.optimizer.step

        def logged_step(*args: Any, **kwargs: Any) -> Any:
            self.log.append("optimizer.step")
            self.step_args, self.step_kwargs = args, kwargs
            return real_step(closure=kwargs.get("closure"))  # Adam calls the closure it is given, returns its loss

        self.optimizer.step = logged_step  # type: ignore[method-assign]
        self.protocol = FakeProtocol(self.log, vote=vote, decided=decided)
        self.gated = CommitGatedOptimizer(
            self.optimizer,
            self.protocol,  # type: ignore[arg-type]
            skip_non_finite=skip_non_finite,
            gradient_check=gradient_check,
        )

    def closure(self, gradient_value: float | None = None) -> Callable[[], torch.Tensor]:
        """Forward and backward; with ``gradient_value`` every gradient is then overwritten with it (inf, NaN)."""

        def run() -> torch.Tensor:
            self.log.append("closure")
            self.optimizer.zero_grad()
            loss = self.model(torch.ones(4, 3)).pow(2).sum()
            loss.backward()
            if gradient_value is not None:
                for param in self.model.parameters():
                    param.grad.fill_(gradient_value)
            return loss

        return run

    def snapshot(self) -> dict[str, Any]:
        """Parameters and optimizer state, deep-copied."""
        return {
            "params": [param.detach().clone() for param in self.model.parameters()],
            "state": {
                index: {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
                for index, state in enumerate(self.optimizer.state.values())
            },
        }


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` alone would call -0.0 and 0.0 equal, and NaN different from itself)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert len(before["params"]) == len(after["params"])
    for old, new in zip(before["params"], after["params"], strict=True):
        assert bit_identical(old, new), "a parameter changed"
    assert before["state"].keys() == after["state"].keys()
    for index, old_state in before["state"].items():
        new_state = after["state"][index]
        assert old_state.keys() == new_state.keys()
        for key, old in old_state.items():
            new = new_state[key]
            assert bit_identical(old, new) if torch.is_tensor(old) else old == new, f"optimizer state {key} changed"


def test_a_committed_step_runs_the_closure_then_the_vote_then_the_optimizer() -> None:
    setup = Setup(vote=True)
    before = setup.snapshot()
    loss = setup.gated.step(setup.closure())
    assert setup.log == ["closure", "vote", "optimizer.step"]
    assert torch.is_tensor(loss) and loss.item() > 0, "step() must return the closure's loss"
    assert setup.protocol.losses == [loss], "the step's loss is read with the vote"
    assert not bit_identical(before["params"][0], setup.model.weight.detach())
    assert len(setup.optimizer.state) == 2, "Adam's state was not created"


def test_a_rejected_step_leaves_parameters_and_optimizer_state_bit_identical() -> None:
    """First a committed step (so Adam has state: moments and a step count), then one the vote rejects."""
    setup = Setup(vote=True)
    setup.gated.step(setup.closure())
    before = setup.snapshot()
    setup.protocol.vote = False
    setup.gated.step(setup.closure())
    assert setup.log == ["closure", "vote", "optimizer.step", "closure", "vote"]
    assert_unchanged(before, setup.snapshot())
    setup.protocol.vote = True
    setup.gated.step(setup.closure())
    assert setup.log[-1] == "optimizer.step", "a rejected step must not stop the next one"


@pytest.mark.parametrize("vote", [True, False])
def test_the_vote_is_taken_exactly_once_per_step(vote: bool) -> None:
    setup = Setup(vote=vote)
    for steps in range(1, 4):
        setup.gated.step(setup.closure())
        setup.protocol._decided = False  # the protocol's close() at the end of the batch
        assert setup.protocol.votes == steps
    assert setup.log.count("closure") == 3


def test_without_a_closure_the_vote_still_gates_the_step_and_nothing_is_returned() -> None:
    setup = Setup(vote=True)
    setup.closure()()
    setup.log.clear()
    assert setup.gated.step() is None
    assert setup.log == ["vote", "optimizer.step"]
    setup.protocol.vote = False
    setup.protocol._decided = False
    before = setup.snapshot()
    setup.gated.step()
    assert setup.log == ["vote", "optimizer.step", "vote"]
    assert_unchanged(before, setup.snapshot())


def test_the_closure_is_passed_on_evaluated_once_and_extra_arguments_are() -> None:
    """The real optimizer gets the closure, as under Lightning, with the extra arguments; its first call returns the
    evaluation the vote was taken on, without running the forward and backward pass again."""
    setup = Setup(vote=True)
    loss = setup.gated.step(setup.closure(), marker="kept")
    assert setup.log == ["closure", "vote", "optimizer.step"]
    assert isinstance(setup.step_kwargs.pop("closure"), EvaluatedClosure)
    assert setup.step_args == () and setup.step_kwargs == {"marker": "kept"}
    assert torch.is_tensor(loss)


def test_a_second_evaluation_runs_the_closure_again_and_asks_the_vote_whether_it_failed() -> None:
    """A two-pass optimizer (SAM) evaluates the closure twice: the second evaluation runs it for real, and the step
    protocol is asked again after the step, which raises when a collective of that evaluation failed."""
    setup = Setup(vote=True)

    def two_passes(closure: Callable[[], Any]) -> Any:
        setup.log.append("optimizer.step")
        closure()
        return closure()

    setup.optimizer.step = two_passes  # type: ignore[method-assign,assignment]
    setup.gated.step(setup.closure())
    assert setup.log == ["closure", "vote", "optimizer.step", "closure", "vote"]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_a_non_finite_gradient_is_rejected_before_the_vote_and_nothing_steps(value: float) -> None:
    setup = Setup(vote=True)
    setup.gated.step(setup.closure())
    before = setup.snapshot()
    setup.log.clear()
    setup.protocol._decided = False
    setup.gated.step(setup.closure(value))
    assert setup.log == ["closure", "reject", "vote"], "the rejection must come after backward and before the vote"
    [reason] = setup.protocol.rejections
    assert isinstance(reason, NonFiniteGradientError) and "step 7" in str(reason)
    assert_unchanged(before, setup.snapshot())


def test_a_single_non_finite_element_is_enough_to_reject() -> None:
    setup = Setup(vote=True)

    def closure() -> torch.Tensor:
        loss = setup.closure()()
        setup.model.bias.grad[1] = float("nan")
        return loss

    setup.gated.step(closure)
    assert len(setup.protocol.rejections) == 1
    assert "optimizer.step" not in setup.log


def test_finite_gradients_are_not_rejected() -> None:
    setup = Setup(vote=True)
    setup.gated.step(setup.closure(1e38))  # large but finite; their sum overflows float32, so the exact check decides
    assert setup.protocol.rejections == []
    assert setup.log == ["closure", "vote", "optimizer.step"]


def test_with_the_skip_off_a_non_finite_gradient_is_stepped_on() -> None:
    setup = Setup(vote=True, skip_non_finite=False)
    setup.gated.step(setup.closure(float("nan")))
    assert setup.protocol.rejections == []
    assert setup.log == ["closure", "vote", "optimizer.step"]


def test_once_the_batch_has_decided_the_gradient_is_not_checked_again() -> None:
    """Manual optimization with several optimizers: the first one's vote decided the batch; a later one must not
    reject (a rejection after the decision would not be shared by the other groups) and reuses the decision."""
    setup = Setup(vote=True, decided=True)
    setup.gated.step(setup.closure(float("nan")))
    assert setup.protocol.rejections == []
    assert setup.log == ["closure", "vote", "optimizer.step"]


@pytest.mark.parametrize(
    ("hook_says", "gradient_value", "rejected"),
    [
        pytest.param(False, None, True, id="the-hook-saw-non-finite"),
        pytest.param(True, float("nan"), False, id="the-hook-saw-finite"),
        pytest.param(None, float("nan"), True, id="the-hook-could-not-tell-so-gradients-are-read"),
        pytest.param(None, None, False, id="could-not-tell-and-finite"),
    ],
)
def test_the_comm_hooks_finding_decides_when_it_has_one(
    hook_says: bool | None, gradient_value: float | None, rejected: bool
) -> None:
    """The comm hook saw the averaged gradient; its answer stands, and only without one are the gradients read."""
    checks: list[None] = []

    def gradient_check() -> Callable[[], bool] | None:
        checks.append(None)
        return None if hook_says is None else lambda: hook_says

    setup = Setup(vote=True, gradient_check=gradient_check)
    setup.gated.step(setup.closure(gradient_value))
    assert len(checks) == 1
    assert bool(setup.protocol.rejections) is rejected
    assert ("optimizer.step" in setup.log) is not rejected


def test_attributes_are_the_wrapped_optimizers() -> None:
    setup = Setup(vote=True)
    setup.gated.step(setup.closure())
    optimizer, gated = setup.optimizer, setup.gated
    assert gated.param_groups is optimizer.param_groups
    assert gated.state is optimizer.state
    assert gated.defaults is optimizer.defaults
    state_dict = gated.state_dict()
    assert state_dict["param_groups"] == optimizer.state_dict()["param_groups"]
    assert state_dict["state"][0]["step"] == 1
    gated.param_groups[0]["lr"] = 0.5  # a scheduler or clipping plugin writing through the view
    assert optimizer.param_groups[0]["lr"] == 0.5
    gated.zero_grad()
    assert all(param.grad is None for param in setup.model.parameters())
    with pytest.raises(AttributeError):
        _ = gated.no_such_attribute

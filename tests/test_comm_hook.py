"""The cross-group comm hook survives a failed allreduce, and refuses to run outside a quorum."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lightning_ft.comm import FTCommState, ft_allreduce_hook
from lightning_ft.commit import QuorumNotStartedError, StepProtocol


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

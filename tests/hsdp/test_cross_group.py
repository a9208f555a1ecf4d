"""HSDP's cross-group average (:mod:`lightning_ft.hsdp.cross_group`) in one real replica group in this process: the
shards of each ``fully_shard`` module cross in one fixed order, whatever the step left out and whatever order the
backward pass reached the modules in, and nothing crosses where nothing was reduced.

Each test records the buffers the Manager's ``allreduce`` is given (real Manager, in-process lighthouse, Gloo,
FSDP2 over a one-process mesh). The modules have distinct sizes, so a buffer's length names its module. What each
catches, checked by running it against FSDP2's plain all-reduce hook (one cross-group collective per module, when
FSDP2 reduces it): the order test fails (the branches cross 16, 27, 18 instead of 27, 18, 16), the left-out test fails
(two collectives in the step that skips a branch instead of three, so the groups' collectives pair up wrongly).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import loader, trainer

from lightning_ft import FTStrategy
from lightning_ft.hsdp.cross_group import ShardAverage, modules_in_order
from lightning_ft.step.protocol import QuorumNotStartedError, StepProtocol

pytestmark = pytest.mark.timeout(180)

# The three branches' sizes (weights and biases): a 8×2 without a bias, b 8×2 with one, c 8×3 with one.
SIZES = {"a": 16, "b": 18, "c": 27}


class Branches(pl.LightningModule):
    """Three parallel branches, registered a, b, c and run b, c, a: the backward pass reaches them a, c, b, while the
    fixed order is the reverse of registration, c, b, a. ``skip`` leaves branch ``b`` out of those batches;
    ``frozen`` freezes branch ``a``."""

    def __init__(self, skip: tuple[int, ...] = (), frozen: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 2, bias=False)
        self.b = torch.nn.Linear(8, 2)
        self.c = torch.nn.Linear(8, 3)
        self.skip = skip
        self.a.requires_grad_(not frozen)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.c(x)[:, :2] if batch_idx in self.skip else self.b(x) + self.c(x)[:, :2]
        out = out + self.a(x)
        return torch.nn.functional.mse_loss(out.sum(dim=1, keepdim=True), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


class RecordCrossings(pl.Callback):
    """Each backward pass's cross-group collectives: the buffer sizes, and which were all zeros."""

    def __init__(self) -> None:
        self.passes: list[list[tuple[int, bool]]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        manager = trainer.strategy.manager
        allreduce = manager.allreduce

        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.passes[-1].append((tensor.numel(), bool((tensor == 0).all())))
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = recorded

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.passes.append([])


def fit(model: Branches, steps: int = 4, **kwargs: Any) -> RecordCrossings:
    record = RecordCrossings()
    strategy = FTStrategy(data_parallel="fsdp", fsdp_wrap=["Linear"])
    trainer(strategy, callbacks=[record], max_steps=steps, **kwargs).fit(model, loader())
    return record


def test_the_fixed_order_is_the_reverse_of_registration_children_before_their_parent():
    record = fit(model := Branches(), steps=1)
    assert record.passes
    names = [
        next(name for name, child in model.named_modules() if child is module) for module, _ in modules_in_order(model)
    ]
    assert names == ["c", "b", "a", ""]


def test_modules_cross_in_the_fixed_order_whatever_order_the_backward_pass_reaches_them():
    record = fit(Branches())
    assert record.passes == [[(SIZES["c"], False), (SIZES["b"], False), (SIZES["a"], False)]] * 4


def test_a_module_the_step_left_out_crosses_as_zeros_in_its_place():
    record = fit(Branches(skip=(0, 2)))
    used = [(SIZES["c"], False), (SIZES["b"], False), (SIZES["a"], False)]
    left_out = [(SIZES["c"], False), (SIZES["b"], True), (SIZES["a"], False)]
    assert record.passes == [left_out, used, left_out, used]


def test_a_frozen_module_does_not_cross_and_keeps_no_gradient():
    model = Branches(frozen=True)
    record = fit(model)
    assert record.passes == [[(SIZES["c"], False), (SIZES["b"], False)]] * 4
    assert model.a.weight.grad is None


def test_accumulation_crosses_once_per_optimizer_step():
    record = fit(Branches(), steps=2, accumulate_grad_batches=3)
    crossed = [crossings for crossings in record.passes if crossings]
    assert len(record.passes) == 6
    assert crossed == [[(SIZES["c"], False), (SIZES["b"], False), (SIZES["a"], False)]] * 2
    assert record.passes[2] and record.passes[5]  # the last micro-batch of each step


class FailedWork:
    """What torchft's ``Manager.allreduce`` returns when a peer died mid-allreduce: ``wait()`` has reported the error
    to the Manager and returns False."""

    def wait(self) -> bool:
        return False


class FakeManager:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def allreduce(self, tensor: torch.Tensor) -> FailedWork:
        self.errors.append("allreduce failed")
        return FailedWork()


def _after_one_reduction(average: ShardAverage) -> None:
    """What FSDP2 does in a backward pass that reduced the first module of the order, then ends."""
    average._reduce_hook(0)(torch.zeros(1))
    average.backward_done()


def test_a_failed_cross_group_allreduce_does_not_raise():
    fit(model := Branches(), steps=1)
    manager = FakeManager()
    _after_one_reduction(ShardAverage(model, manager, torch.device("cpu")))  # type: ignore[arg-type]
    assert manager.errors == ["allreduce failed"] * 3  # every module crossed: the step's vote will say no


def test_gradients_do_not_cross_without_the_steps_quorum():
    fit(model := Branches(), steps=1)
    protocol = StepProtocol(manager=FakeManager())  # type: ignore[arg-type]
    average = ShardAverage(model, FakeManager(), torch.device("cpu"), protocol.require_quorum)  # type: ignore[arg-type]
    with pytest.raises(QuorumNotStartedError):
        _after_one_reduction(average)

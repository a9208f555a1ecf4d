"""Lightning's callback loop calls an FT callback only at the per-batch hooks its class overrides (_batch_hooks.py)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.model_helpers import is_overridden

import lightning_ft.callbacks as ft_callbacks
from lightning_ft.callbacks._batch_hooks import PER_BATCH_HOOKS, FTCallback

TRAINING_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class ActionNames(Profiler):
    """Records the name of every profiled action: Lightning profiles each callback hook it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def start(self, action_name: str) -> None:
        self.names.append(action_name)

    def stop(self, action_name: str) -> None:
        pass

    def summary(self) -> str:
        return ""


class EndsBatches(FTCallback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.calls.append("on_train_batch_end")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        super().on_before_backward(trainer, pl_module, loss)  # Callback's no-op, reached through super()
        self.calls.append("on_before_backward")


class AlsoAfterBackward(EndsBatches):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_after_backward(trainer, pl_module)
        self.calls.append("on_after_backward")


class Plain(Callback):
    pass


class BackwardCounter(Callback):
    """Another library's callback, overriding a per-batch hook that an FT callback leaves alone."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.calls.append("on_before_backward")


class OnlyEndsBatches(FTCallback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pass


class Mixed(OnlyEndsBatches, BackwardCounter):
    """FTCallback comes before BackwardCounter in the method resolution order: its override must still be called."""


def _hooks_called(profiler: ActionNames, callback: Callback) -> set[str]:
    prefix = f"[Callback]{callback.state_key}."
    return {name.removeprefix(prefix) for name in profiler.names if name.startswith(prefix)}


def test_lightning_calls_an_ft_callback_only_at_the_per_batch_hooks_its_class_overrides(tmp_path):
    ends, also, plain, mixed = EndsBatches(), AlsoAfterBackward(), Plain(), Mixed()
    profiler = ActionNames()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        limit_val_batches=0,
        callbacks=[ends, also, plain, mixed],
        profiler=profiler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())

    # The control: Lightning calls a plain callback at every hook of a training step.
    assert set(TRAINING_STEP_HOOKS) <= _hooks_called(profiler, plain)
    per_batch = set(PER_BATCH_HOOKS)
    assert _hooks_called(profiler, ends) & per_batch == {"on_train_batch_end", "on_before_backward"}
    assert _hooks_called(profiler, also) & per_batch == {
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
    }
    # The overrides ran, once a step, their super() calls included.
    assert sorted(ends.calls) == sorted(["on_train_batch_end", "on_before_backward"] * 3)
    assert sorted(also.calls) == sorted(["on_train_batch_end", "on_before_backward", "on_after_backward"] * 3)
    assert _hooks_called(profiler, mixed) & per_batch == {"on_train_batch_end", "on_before_backward"}
    assert mixed.calls == ["on_before_backward"] * 3
    # Hooks that are not per batch are Lightning's as ever.
    assert {"setup", "on_train_start", "on_train_end", "teardown"} <= _hooks_called(profiler, ends)


def test_a_skipped_hook_reads_as_not_overridden_and_the_class_keeps_callbacks_no_op():
    ends = EndsBatches()
    assert ends.on_after_backward is None
    assert not is_overridden("on_after_backward", ends, Callback)
    assert is_overridden("on_train_batch_end", ends, Callback)
    assert EndsBatches.on_after_backward is Callback.on_after_backward


FT_CALLBACKS = [
    cls
    for name in ft_callbacks.__all__
    if isinstance(cls := getattr(ft_callbacks, name), type) and issubclass(cls, Callback)
]


@pytest.mark.parametrize("cls", FT_CALLBACKS, ids=lambda cls: cls.__name__)
def test_every_lightning_ft_callback_skips_the_per_batch_hooks_it_leaves_alone(cls):
    assert issubclass(cls, FTCallback)
    overridden = {hook for hook in PER_BATCH_HOOKS if is_overridden(hook, cls, Callback)}
    callable_on_instance = {hook for hook in PER_BATCH_HOOKS if callable(getattr(cls.__new__(cls), hook))}
    assert callable_on_instance == overridden
    assert len(overridden) <= 3

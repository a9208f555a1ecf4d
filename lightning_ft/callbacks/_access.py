"""How a callback finds the fault-tolerance parts of the running strategy.

Callbacks do not import FTStrategy: any strategy that exposes a torchft ``manager``, a ``step_protocol`` and (for
sync sections) ``collectives`` works.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torchft import Manager

from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.protocol import StepProtocol


def has_ft_manager(trainer: pl.Trainer) -> bool:
    try:
        return isinstance(getattr(trainer.strategy, "manager", None), Manager)
    except RuntimeError:  # FTStrategy outside fitting: no Manager exists
        return False


def ft_manager(trainer: pl.Trainer) -> Manager:
    if not has_ft_manager(trainer):
        raise RuntimeError(
            f"This callback needs lightning_ft.FTStrategy (or a strategy exposing a torchft `manager`), but the "
            f"trainer runs {type(trainer.strategy).__name__} (or is not fitting). Use Trainer(strategy='ft')."
        )
    return trainer.strategy.manager  # type: ignore[attr-defined]


def ft_step_protocol(trainer: pl.Trainer) -> StepProtocol:
    ft_manager(trainer)
    protocol = getattr(trainer.strategy, "step_protocol", None)
    if not isinstance(protocol, StepProtocol):
        raise RuntimeError("This callback needs a strategy exposing a lightning_ft StepProtocol as `step_protocol`.")
    return protocol


def ft_collectives(trainer: pl.Trainer) -> CrossGroupCollectives:
    ft_manager(trainer)
    collectives = getattr(trainer.strategy, "collectives", None)
    if not isinstance(collectives, CrossGroupCollectives):
        raise RuntimeError("This callback needs a strategy exposing lightning_ft `collectives`. Use FTStrategy.")
    return collectives


def ft_telemetry(trainer: pl.Trainer) -> FTTelemetry | None:
    """The strategy's fault-tolerance figures, or ``None`` for a strategy that keeps none (they are optional)."""
    try:
        telemetry = getattr(trainer.strategy, "telemetry", None)
    except RuntimeError:  # FTStrategy outside fitting, validating, testing
        return None
    return telemetry if isinstance(telemetry, FTTelemetry) else None

"""What a callback may read from the running strategy: the :class:`FaultTolerantStrategy` contract.

Callbacks do not import FTStrategy: any strategy with these attributes works (a subclass of another Lightning
strategy, a test's stand-in). Each accessor below checks what it reads and raises a message naming the fix, or
returns ``None`` where the part is optional.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import lightning.pytorch as pl
from torchft import Manager

from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.algorithms.sync_owner import SyncOwner
from lightning_ft.data.placement import ExactlyOnceData
from lightning_ft.errors import StrategyRequiredError
from lightning_ft.manager.telemetry import FTTelemetry
from lightning_ft.settings import FTSettings
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.owner import StepOwner
from lightning_ft.step.protocol import StepProtocol

T = TypeVar("T")


class FaultTolerantStrategy(Protocol):
    """The attributes of a strategy that the lightning-ft callbacks read. ``manager``, ``collectives`` and
    ``telemetry`` exist while fitting, validating and testing; ``step_protocol`` and ``step_owner`` while fitting
    (the one owner of the fit's steps: a ``StepOwner`` per step, a ``SyncOwner`` semi-synchronously). Each raises
    ``RuntimeError`` outside those times."""

    settings: FTSettings
    algorithm: AlgorithmSettings

    @property
    def manager(self) -> Manager: ...

    @property
    def step_protocol(self) -> StepProtocol: ...

    @property
    def step_owner(self) -> StepOwner | SyncOwner: ...

    @property
    def collectives(self) -> CrossGroupCollectives: ...

    @property
    def telemetry(self) -> FTTelemetry: ...

    @property
    def exactly_once_data(self) -> ExactlyOnceData | None: ...


def has_ft_manager(trainer: pl.Trainer) -> bool:
    try:
        return isinstance(getattr(trainer.strategy, "manager", None), Manager)
    except RuntimeError:  # FTStrategy outside fitting: no Manager exists
        return False


def ft_manager(trainer: pl.Trainer) -> Manager:
    if not has_ft_manager(trainer):
        raise StrategyRequiredError(
            f"This callback needs lightning_ft.FTStrategy (or a strategy exposing a torchft `manager`), but the "
            f"trainer runs {type(trainer.strategy).__name__} (or is not fitting). Use Trainer(strategy='ft')."
        )
    return trainer.strategy.manager  # type: ignore[attr-defined]


def ft_step_protocol(trainer: pl.Trainer) -> StepProtocol:
    return _required_part(trainer, "step_protocol", StepProtocol)


def ft_step_owner(trainer: pl.Trainer) -> StepOwner:
    """The owner of each optimizer step of a per-step fit (``algorithm="ddp"``)."""
    return _required_part(trainer, "step_owner", StepOwner)


def ft_sync_owner(trainer: pl.Trainer) -> SyncOwner:
    """The owner of each sync of a semi-synchronous fit (``algorithm="local_sgd"`` or ``"diloco"``)."""
    if not is_semi_sync(trainer):
        raise StrategyRequiredError("SyncCallback needs FTStrategy(algorithm='local_sgd') or 'diloco'.")
    return _required_part(trainer, "step_owner", SyncOwner)


def has_step_protocol(trainer: pl.Trainer) -> bool:
    """Whether the strategy runs lightning-ft's step protocol (a stand-in strategy may not)."""
    try:
        return isinstance(getattr(trainer.strategy, "step_protocol", None), StepProtocol)
    except RuntimeError:  # FTStrategy outside fitting
        return False


def ft_collectives(trainer: pl.Trainer) -> CrossGroupCollectives:
    return _required_part(trainer, "collectives", CrossGroupCollectives)


def _required_part(trainer: pl.Trainer, name: str, kind: type[T]) -> T:
    ft_manager(trainer)
    part = getattr(trainer.strategy, name, None)
    if not isinstance(part, kind):
        raise StrategyRequiredError(
            f"This callback needs a strategy exposing a lightning_ft {kind.__name__} as `{name}`."
        )
    return part


def ft_telemetry(trainer: pl.Trainer) -> FTTelemetry | None:
    """The strategy's fault-tolerance figures, or ``None`` for a strategy that keeps none (they are optional)."""
    try:
        telemetry = getattr(trainer.strategy, "telemetry", None)
    except RuntimeError:  # FTStrategy outside fitting, validating, testing
        return None
    return telemetry if isinstance(telemetry, FTTelemetry) else None


def ft_settings(trainer: pl.Trainer) -> FTSettings | None:
    """The group's resolved settings, or ``None`` for a strategy without them."""
    settings = getattr(trainer.strategy, "settings", None)
    return settings if isinstance(settings, FTSettings) else None


def ft_algorithm(trainer: pl.Trainer) -> AlgorithmSettings | None:
    """How the groups synchronise, or ``None`` for a strategy that does not say (every step, as with DDP)."""
    algorithm = getattr(trainer.strategy, "algorithm", None)
    return algorithm if isinstance(algorithm, AlgorithmSettings) else None


def ft_data_mode(trainer: pl.Trainer) -> str | None:
    """``"sharded"`` or ``"exactly_once"``, or ``None`` for a strategy that does not say (sharded, as with DDP)."""
    mode = getattr(trainer.strategy, "data_mode", None)
    return mode if isinstance(mode, str) else None


def is_semi_sync(trainer: pl.Trainer) -> bool:
    algorithm = ft_algorithm(trainer)
    return algorithm is not None and algorithm.semi_sync


def ft_exactly_once_data(trainer: pl.Trainer) -> ExactlyOnceData | None:
    data = getattr(trainer.strategy, "exactly_once_data", None)
    return data if isinstance(data, ExactlyOnceData) else None

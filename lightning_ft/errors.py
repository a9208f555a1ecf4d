"""The root of the errors lightning-ft raises, so that a user can catch them all at once.

Every exception class of the package derives from :class:`LightningFTError` *and* from the built-in type it always
had (``RuntimeError``, ``ValueError``, ``ConnectionError``...), so existing ``except`` clauses keep working. The one
exception is :class:`~lightning_ft.callbacks.failure_injector.InjectedFailure`, which stands for a failure of the
user's code or hardware in a rehearsal and must be handled like one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl


class LightningFTError(Exception):
    """Base class of every error raised by lightning-ft (``except lightning_ft.LightningFTError``)."""


class NotAvailableError(LightningFTError, RuntimeError):
    """A part of lightning-ft was asked for outside the time it exists: for example ``FTStrategy.manager`` before
    ``setup_environment()`` or after the fit. The message says when it is available."""


def attached_module(strategy: pl.strategies.Strategy) -> pl.LightningModule:
    """The strategy's LightningModule, which Lightning attaches before it calls any hook that reads it.

    Raises:
        NotAvailableError: None is attached yet.
    """
    if strategy.lightning_module is None:
        raise NotAvailableError("FTStrategy: no LightningModule is attached yet.")
    return strategy.lightning_module


class StrategyRequiredError(LightningFTError, RuntimeError):
    """A lightning-ft callback runs under a strategy without the part it needs (use ``Trainer(strategy="ft")``)."""


class UnsupportedModelError(LightningFTError, RuntimeError):
    """The model does something fault tolerance cannot keep consistent across replicas (buffers that change shape,
    parameters FSDP2 does not manage, fragments that differ from a checkpoint's). The message names the fix."""


class UnsupportedArgumentError(LightningFTError, ValueError):
    """An argument of a lightning-ft function or class has a value it does not support (not a strategy setting:
    those raise :class:`~lightning_ft.settings.FTConfigError`)."""

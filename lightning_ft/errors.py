"""The root of the errors lightning-ft raises, so that a user can catch them all at once.

Every exception class of the package derives from :class:`LightningFTError` *and* from the built-in type it always
had (``RuntimeError``, ``ValueError``, ``ConnectionError``...), so existing ``except`` clauses keep working. The one
exception is :class:`~lightning_ft.callbacks.failure_injector.InjectedFailure`, which stands for a failure of the
user's code or hardware in a rehearsal and must be handled like one.
"""

from __future__ import annotations


class LightningFTError(Exception):
    """Base class of every error raised by lightning-ft (``except lightning_ft.LightningFTError``)."""

"""The base of the lightning-ft callbacks: the per-batch hooks a callback does not override cost nothing per batch.

Lightning calls every callback at each per-batch hook (six per training step: batch start and end, before and after
backward, before the optimizer step and before ``zero_grad``), each call inside a profiler context named after the
callback's state key, whether the callback overrides the hook or inherits ``Callback``'s no-op. Its callback loop
(``_call_callback_hooks``) skips a hook that is not callable. FTStrategy adds seven callbacks; of their 42 calls a
training step, 5 reach code of theirs, and the others were a no-op in a profiler context each, about 1.7 µs apiece.

:class:`FTCallback` puts a descriptor in place of each per-batch hook: on an instance whose class overrides the hook
it is never reached (the override comes first in the method resolution order); on one whose class does not, it reads
``None``, which Lightning skips and ``is_overridden`` reports as not overridden; through ``super()`` from an override,
or on the class, it reads ``Callback``'s no-op, so a subclass's ``super().on_train_batch_end(...)`` still works; in a
class that also derives from another callback, whose override comes after :class:`FTCallback` in the method
resolution order, it reads that override.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from lightning.pytorch.callbacks import Callback

PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


class _InheritedNoOp:
    """Stands in an :class:`FTCallback` class for ``Callback``'s no-op per-batch hook ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._no_op = getattr(Callback, name)

    def __get__(self, instance: Any, owner: type | None = None) -> Callable[..., None] | None:
        if instance is None:
            return self._no_op  # read on the class: Callback's function
        cls = type(instance)
        if self._name not in cls._overridden_batch_hooks:
            return None  # nothing in the class overrides the hook: Lightning skips it
        # Reached through super() from an override, or the override comes after FTCallback in the method resolution
        # order (a class that also derives from another callback): what the name means without this stand-in.
        after = cls.__mro__[cls.__mro__.index(FTCallback) + 1 :]
        hook = next(vars(klass)[self._name] for klass in after if self._name in vars(klass))
        bind = getattr(hook, "__get__", None)  # a plain function; a callable object is returned as it is
        return cast(Callable[..., None], bind(instance, cls) if bind is not None else hook)


class FTCallback(Callback):
    """A Lightning ``Callback`` whose per-batch hooks it does not override are skipped by Lightning's callback loop
    (module docstring). Subclass it as ``Callback``; nothing else changes."""

    _overridden_batch_hooks: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = [klass for klass in cls.__mro__ if klass not in (FTCallback, Callback, object)]
        cls._overridden_batch_hooks = frozenset(
            name for name in PER_BATCH_HOOKS if any(name in vars(klass) for klass in own)
        )


for _name in PER_BATCH_HOOKS:
    setattr(FTCallback, _name, _InheritedNoOp(_name))

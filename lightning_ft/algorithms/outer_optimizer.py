"""DiLoCo's outer optimizer, given as LightningCLI-style YAML or as a callable.

The outer optimizer steps the *global* parameters with the averaged pseudo-gradient once per sync. It is created
per fragment, after the model exists, so the setting is a recipe, not an optimizer: either
``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7}}`` (what jsonargparse hands over from YAML) or a
callable ``params -> Optimizer``. The recipe is checked when the strategy is built, so a typo in a class path or an
argument fails at once instead of after the first ``sync_every`` steps.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_ft.settings import FTConfigError

OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]
OuterOptimizerSpec = Mapping[str, Any] | OuterOptimizerFactory | None

# The DiLoCo paper's outer optimizer.
DEFAULT_OUTER_OPTIMIZER: dict[str, Any] = {
    "class_path": "torch.optim.SGD",
    "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
}

_SETTING = "outer_optimizer"


@dataclass(frozen=True)
class ClassFactory:
    """``params -> cls(params, **init_args)``; a class rather than a closure so that the strategy stays picklable."""

    cls: type[Optimizer]
    init_args: dict[str, Any]

    def __call__(self, params: Iterable[Tensor]) -> Optimizer:
        return self.cls(params, **self.init_args)


def _import_class(class_path: str) -> type:
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise FTConfigError(
            f"{_SETTING}.class_path={class_path!r}: give the full import path, for example 'torch.optim.SGD'."
        )
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise FTConfigError(
            f"{_SETTING}.class_path={class_path!r} cannot be imported ({error}). Give the full import path of an "
            f"optimizer class, for example 'torch.optim.SGD'."
        ) from None
    if not (inspect.isclass(cls) and issubclass(cls, Optimizer)):
        raise FTConfigError(f"{_SETTING}.class_path={class_path!r} is not a torch.optim.Optimizer subclass.")
    return cls


def _from_mapping(spec: Mapping[str, Any]) -> OuterOptimizerFactory:
    unknown = set(spec) - {"class_path", "init_args"}
    if unknown or "class_path" not in spec:
        raise FTConfigError(
            f"{_SETTING}={dict(spec)!r}: expected {{'class_path': 'torch.optim.SGD', 'init_args': {{...}}}}"
            + (f"; unknown keys {sorted(unknown)}" if unknown else "; class_path is missing")
            + "."
        )
    cls = _import_class(str(spec["class_path"]))
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        raise FTConfigError(f"{_SETTING}.init_args={init_args!r}: must be a mapping of keyword arguments.")
    init_args = dict(init_args)
    if "params" in init_args:
        raise FTConfigError(
            f"{_SETTING}.init_args: remove 'params'; the outer optimizer is given each fragment's parameters."
        )
    try:
        inspect.signature(cls).bind(params=[], **init_args)
    except TypeError as error:
        raise FTConfigError(f"{_SETTING}.init_args={init_args!r} do not fit {cls.__name__}: {error}.") from None

    return ClassFactory(cls, init_args)


def outer_optimizer_factory(spec: OuterOptimizerSpec) -> OuterOptimizerFactory:
    """Turn the ``outer_optimizer`` setting into a factory ``params -> Optimizer``; ``None`` gives the default
    (Nesterov SGD, lr 0.7, momentum 0.9)."""
    if spec is None:
        return _from_mapping(DEFAULT_OUTER_OPTIMIZER)
    if isinstance(spec, Mapping):
        return _from_mapping(spec)
    if callable(spec):
        return spec
    raise FTConfigError(
        f"{_SETTING}={spec!r}: expected {{'class_path': ..., 'init_args': {{...}}}} or a callable params -> Optimizer."
    )

"""Every error lightning-ft raises can be caught as ``LightningFTError``, and still as the type it always was."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning_ft
from lightning_ft import FTConfigError, LighthouseUnreachableError, LightningFTError
from lightning_ft.callbacks.failure_injector import InjectedFailure


def exception_classes() -> dict[str, type[Exception]]:
    """Every Exception subclass defined in the package (a SystemExit such as JobAlreadyFinished is not an error)."""
    found = {}
    for module_info in pkgutil.walk_packages(lightning_ft.__path__, "lightning_ft."):
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_public_exception_class_derives_from_lightning_ft_error():
    classes = exception_classes()
    assert len(classes) >= 20, sorted(classes)
    outside = [
        name
        for name, cls in classes.items()
        if not issubclass(cls, LightningFTError)
        and cls is not InjectedFailure
        and not name.rsplit(".", 1)[1].startswith("_")
    ]
    assert not outside, f"not under LightningFTError: {outside}"


def test_the_built_in_types_still_catch_them():
    assert issubclass(FTConfigError, ValueError) and issubclass(LighthouseUnreachableError, ConnectionError)
    assert not issubclass(InjectedFailure, LightningFTError), "a rehearsed failure is the user's, not ours"

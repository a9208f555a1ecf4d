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


BUILT_IN_ERRORS = {"Exception", "RuntimeError", "ValueError", "TypeError", "ConnectionError", "TimeoutError", "OSError"}


def bare_raises(source: str, filename: str) -> list[str]:
    """Each ``raise <built-in error>(...)`` in ``source``: an error a user could not catch as ``LightningFTError``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        call = node.exc if isinstance(node, ast.Raise) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in BUILT_IN_ERRORS:
            found.append(f"{filename}:{node.lineno}: raise {call.func.id}")
    return found


def test_the_package_raises_no_bare_built_in_error():
    from pathlib import Path

    root = Path(lightning_ft.__file__).parent
    found = [use for path in sorted(root.rglob("*.py")) for use in bare_raises(path.read_text(), path.name)]
    assert not found, found


def test_the_bare_raise_check_sees_one():
    assert bare_raises("def f():\n    raise RuntimeError('x')\n", "m.py") == ["m.py:2: raise RuntimeError"]
    assert bare_raises("def f():\n    raise FTConfigError('x')\n", "m.py") == []

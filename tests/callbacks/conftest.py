"""Fixtures of the callback tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_ft.manager import FTManager


@pytest.fixture
def registered_heal_states(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[Callable, Callable]]]:
    """Every ``(load, save)`` pair registered with a Manager of the test's fits, by heal-state key, in order."""
    registered: dict[str, list[tuple[Callable, Callable]]] = {}
    register = FTManager.register_state_dict_fn

    def recording(self: FTManager, key: str, load: Callable, save: Callable[[], Any]) -> None:
        registered.setdefault(key, []).append((load, save))
        register(self, key, load, save)

    monkeypatch.setattr(FTManager, "register_state_dict_fn", recording)
    return registered

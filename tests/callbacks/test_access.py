"""The callbacks' contract with the strategy (``callbacks/_access.py``): each required part names FTStrategy when it
is missing, each optional one is ``None`` or ``False``, without a fit."""

from __future__ import annotations

import pytest
from helpers import trainer as make_trainer

from lightning_ft import FTStrategy
from lightning_ft.callbacks import _access
from lightning_ft.errors import StrategyRequiredError

REQUIRED = ("ft_manager", "ft_step_protocol", "ft_step_owner", "ft_sync_owner", "ft_collectives")
OPTIONAL = {
    "ft_telemetry": None,
    "ft_settings": None,
    "ft_algorithm": None,
    "ft_exactly_once_data": None,
    "has_ft_manager": False,
    "has_step_protocol": False,
    "is_semi_sync": False,
}


@pytest.mark.parametrize("accessor", REQUIRED)
def test_a_required_part_under_another_strategy_names_ftstrategy(accessor):
    trainer = make_trainer(strategy="auto")
    with pytest.raises(StrategyRequiredError, match=r"FTStrategy|strategy exposing"):
        getattr(_access, accessor)(trainer)


@pytest.mark.parametrize(("accessor", "value"), OPTIONAL.items())
def test_an_optional_part_under_another_strategy_is_absent(accessor, value):
    assert getattr(_access, accessor)(make_trainer(strategy="auto")) is value


@pytest.mark.usefixtures("one_group_environment")
def test_ftstrategy_before_its_fit_has_settings_but_no_manager():
    trainer = make_trainer(FTStrategy(algorithm="local_sgd", sync_every=2))
    assert _access.ft_settings(trainer) is trainer.strategy.settings
    assert _access.is_semi_sync(trainer)
    assert not _access.has_ft_manager(trainer) and _access.ft_telemetry(trainer) is None
    with pytest.raises(StrategyRequiredError):
        _access.ft_sync_owner(trainer)

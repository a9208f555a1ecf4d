"""A pytest plugin that runs Lightning's own tests under ``FTStrategy``: every Trainer that would train on one device
(no strategy chosen, one CPU device, one node) gets ``FTStrategy()`` instead: one replica group, the in-process
lighthouse. ``tests/lightning_suite/run.py`` loads it (``-p ft_plugin``) and records what differs.

Only the Trainer's constructor is wrapped; nothing else of Lightning or of the tests is touched, so a test that fails
here and passes without the plugin fails because of lightning-ft.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl

# The reason ``-p ft_plugin`` was given: the test report says the run was under FTStrategy.
FT_STRATEGY_MARK = "lightning-ft: single-device Trainers run under FTStrategy()"

_ONE_DEVICE = (None, "auto", 1, "1", [0], (0,))
_CPU = (None, "auto", "cpu")


def runs_on_one_device(kwargs: dict[str, Any]) -> bool:
    """Whether a ``Trainer(**kwargs)`` would pick Lightning's single-device strategy on this CPU machine (a test that
    sets the Trainer's arguments through ``PL_TRAINER_*`` variables is left as it is)."""
    strategy = kwargs.get("strategy", "auto")
    if strategy not in ("auto", None, "single_device"):
        return False
    if kwargs.get("num_nodes", 1) != 1:
        return False
    accelerator = kwargs.get("accelerator", "auto")
    if not (accelerator in _CPU or isinstance(accelerator, pl.accelerators.CPUAccelerator)):
        return False
    devices = kwargs.get("devices", "auto")
    return devices in _ONE_DEVICE and not any(name.startswith("PL_TRAINER_") for name in os.environ)


# ``ddp`` instead of ``ft``: Lightning's own DDPStrategy with one process, the control that tells a difference of data
# parallelism (which DDPStrategy shares) from one of fault tolerance.
ENV_STRATEGY = "LIGHTNING_FT_SUITE_STRATEGY"


def _new_strategy() -> Any:
    if os.environ.get(ENV_STRATEGY, "ft") == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    from lightning_ft import FTStrategy

    return FTStrategy()


def _give_trainers_ft_strategy() -> None:
    original = pl.Trainer.__init__
    if getattr(original, "_lightning_ft_wrapped", False):
        return

    @functools.wraps(original)
    def init(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if not args and runs_on_one_device(kwargs):
            kwargs = {**kwargs, "strategy": _new_strategy()}
        original(self, *args, **kwargs)

    init._lightning_ft_wrapped = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = init  # type: ignore[method-assign]


def pytest_configure(config: Any) -> None:
    import lightning_ft  # noqa: F401  # before the tests: importing it sets RUST_LOG, which is not a test's doing

    _give_trainers_ft_strategy()
    # torchft keeps two timer threads per process (``torchft.futures``), started on first use and shared by every fit
    # after it. Started here, before the tests, so that Lightning's thread check (which fails a test that leaves a
    # thread it did not find) does not count them against whichever test happens to fit first.
    from torchft.futures import _TIMEOUT_MANAGER

    _TIMEOUT_MANAGER._maybe_start_event_loop()


def pytest_report_header(config: Any) -> str:
    return (
        FT_STRATEGY_MARK
        if os.environ.get(ENV_STRATEGY, "ft") == "ft"
        else "single-device Trainers run under DDPStrategy()"
    )

"""QuorumCallback: the step begins at the batch start, before the other callbacks' hooks and the forward pass."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from helpers import Regressor, loader
from helpers import trainer as make_trainer

from lightning_ft import FTStrategy
from lightning_ft.callbacks import QuorumCallback
from lightning_ft.errors import StrategyRequiredError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


class SeesTheStep(pl.Callback):
    """At each batch start, after QuorumCallback: whether the quorum is open and global_step is the committed step."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool]] = []
        self.quorums = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        protocol = trainer.strategy.step_protocol
        self.seen.append((protocol.quorum_open, trainer.global_step == trainer.strategy.manager.current_step()))

    def on_train_end(self, trainer, pl_module) -> None:
        self.quorums = trainer.strategy.step_protocol.quorums_opened


def test_the_quorum_is_open_for_the_next_callback_and_opens_once_per_optimizer_step(tmp_path):
    sees = SeesTheStep()
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20),
        [QuorumCallback(), sees],
        max_steps=3,
        accumulate_grad_batches=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(), loader())
    assert sees.seen == [(True, True)] * 6  # 3 optimizer steps of 2 micro-batches
    assert sees.quorums == 3
    assert sum(isinstance(cb, QuorumCallback) for cb in trainer.callbacks) == 1  # the user's, not a second one


def test_under_another_strategy_it_names_the_fix(tmp_path):
    trainer = make_trainer("auto", [QuorumCallback()], max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(StrategyRequiredError):
        trainer.fit(Regressor(), loader())

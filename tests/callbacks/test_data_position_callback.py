"""DataPositionCallback on its own: the loop position it adds to the heal payload is the one at the step's start,
where a peer healing in that quorum resumes. (Moving a healed group's iterator, and resuming from sidecars, are
tests/data/test_data_position.py's.)"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from helpers import Regressor, loader
from helpers import trainer as make_trainer

from lightning_ft import FTStrategy
from lightning_ft.callbacks import DataPositionCallback
from lightning_ft.callbacks.data_position import DATA_POSITION_KEY
from lightning_ft.errors import StrategyRequiredError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


class SentPositions(pl.Callback):
    """What the payload would carry, read in the middle of each batch (after the step began, before it ended)."""

    def __init__(self, registered: dict) -> None:
        self.registered = registered
        self.sent: list[dict] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        _, save = self.registered[DATA_POSITION_KEY][-1]
        self.sent.append(save())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_payload_carries_the_position_at_the_steps_start(tmp_path, registered_heal_states, accumulate):
    registered = registered_heal_states
    sent = SentPositions(registered)
    batches = len(loader())  # 64 batches an epoch
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20),
        [DataPositionCallback(), sent],
        max_steps=(batches + 2) // accumulate,
        accumulate_grad_batches=accumulate,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(), loader())
    # In the step that begins with batch s, the loop has read batch s: a peer healing in its quorum trains its own
    # batch s in the same step and reads on from s + 1. Every micro-batch of the step sends that same position.
    starts = [b - b % accumulate for b in range(batches + 2)]
    wanted = [{"epoch": s // batches, "current_ready": s % batches + 1, "total_ready": s + 1} for s in starts]
    assert sent.sent == wanted


def test_under_another_strategy_it_names_the_fix(tmp_path):
    trainer = make_trainer("auto", [DataPositionCallback()], max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(StrategyRequiredError):
        trainer.fit(Regressor(), loader())

"""StateTransferCallback: the training state it registers with the Manager is Lightning's checkpoint, and loading it
puts a replica back where the sender was (what a heal does, here within one process)."""

from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, assert_tree_equal, loader
from helpers import trainer as make_trainer

from lightning_ft import FTConfigError, FTStrategy
from lightning_ft.callbacks import StateTransferCallback
from lightning_ft.errors import StrategyRequiredError
from lightning_ft.heal.state import STATE_KEY

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


class HealsItselfAtTheEnd(pl.Callback):
    """At the fit's end: take the registered state, change the model and the optimizer, load the state back."""

    def __init__(self, registered: dict) -> None:
        self.registered = registered
        self.before: dict | None = None
        self.after: dict | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        load, save = self.registered[STATE_KEY][-1]
        sent = io.BytesIO()
        torch.save(save(), sent)  # as the transport sends it: a copy, not the live tensors
        sent.seek(0)
        state = torch.load(sent, weights_only=True)
        self.before = {"model": dict(pl_module.state_dict()), "optimizer": trainer.optimizers[0].state_dict()}
        self.before = {key: _copy(value) for key, value in self.before.items()}
        with torch.no_grad():
            for parameter in pl_module.parameters():
                parameter.add_(1.0)
        trainer.optimizers[0].state.clear()
        load(state)
        self.after = {"model": dict(pl_module.state_dict()), "optimizer": trainer.optimizers[0].state_dict()}


def _copy(value):
    return torch.utils._pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, value)


def test_the_registered_state_puts_a_changed_replica_back(tmp_path, registered_heal_states):
    registered = registered_heal_states
    heals = HealsItselfAtTheEnd(registered)
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20),
        [StateTransferCallback(), heals],
        max_steps=3,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(), loader())
    assert len(registered[STATE_KEY]) == 1  # once per fit, on the fit's own Manager
    assert_tree_equal(heals.after, heals.before)
    assert trainer.global_step == 3


def test_under_another_strategy_it_names_the_fix(tmp_path):
    trainer = make_trainer("auto", [StateTransferCallback()], max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(StrategyRequiredError, match="FTStrategy"):
        trainer.fit(Regressor(), loader())


def test_a_callback_given_twice_is_refused_naming_the_heal_state(tmp_path):
    """Two instances register the same heal state; torchft would only assert. Any callback that registers one
    (here the state transfer) is refused at its second registration, with the key and the fix."""
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20),
        [StateTransferCallback(), StateTransferCallback()],
        max_steps=1,
        default_root_dir=tmp_path,
    )
    with pytest.raises(FTConfigError, match=r"register the heal state 'lightning'.*Keep one"):
        trainer.fit(Regressor(), loader())

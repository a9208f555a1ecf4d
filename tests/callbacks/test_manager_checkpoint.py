"""ManagerCheckpointCallback: the Manager's committed step goes into Lightning's checkpoint and comes back from it."""

from __future__ import annotations

import pytest
import torch
from helpers import Regressor, loader
from helpers import trainer as make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import FTStrategy
from lightning_ft.callbacks import ManagerCheckpointCallback

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


def test_the_checkpoint_holds_the_managers_step_and_a_resume_continues_from_it(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20),
        [ManagerCheckpointCallback(), checkpoints],
        max_steps=4,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(), loader())
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=True)
    [state] = [value for key, value in saved["callbacks"].items() if key.startswith("ManagerCheckpointCallback")]
    assert state["manager"]["step"] == 4

    resumed = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20), [ManagerCheckpointCallback()], max_steps=6, default_root_dir=tmp_path
    )
    resumed.fit(Regressor(), loader(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed.global_step == 6  # 2 from the checkpoint's committed steps, 4 more


def test_without_a_manager_it_saves_nothing():
    assert ManagerCheckpointCallback().state_dict() == {}

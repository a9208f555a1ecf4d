"""LocalSGD in one process: inner steps count in ``global_step``, syncs in the Manager step, LR schedulers follow
inner steps, nothing crosses groups between syncs."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer as make_trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ft import FTStrategy
from lightning_ft.callbacks import QuorumCallback, SyncCallback


@pytest.fixture(autouse=True)
def _single_group(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.quorum_open_in_step: list[bool] = []
        self.lrs: list[float] = []
        self.final: tuple[int, int] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.quorum_open_in_step.append(trainer.strategy.step_protocol.quorum_open)

    def on_train_batch_end(self, trainer, *args) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:  # runs after SyncCallback's final sync (callback order)
        self.final = (trainer.global_step, trainer.strategy.manager.current_step())


class Scheduled(BoringModel):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(tmp_path, max_steps: int, sync_every: int, **trainer_kwargs) -> tuple[pl.Trainer, Recorder]:
    recorder = Recorder()
    trainer = make_trainer(
        FTStrategy(algorithm="local_sgd", sync_every=sync_every, timeout=20, quorum_timeout=20),
        [recorder],
        max_steps=max_steps,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(Scheduled())
    return trainer, recorder


def test_global_step_counts_inner_steps_and_manager_step_counts_syncs(tmp_path):
    trainer, recorder = fit(tmp_path, max_steps=6, sync_every=2)
    assert any(isinstance(cb, SyncCallback) for cb in trainer.callbacks)
    assert not any(isinstance(cb, QuorumCallback) for cb in trainer.callbacks)
    # the join sync at the start, after inner steps 2 and 4, and the final sync after step 6
    assert recorder.final == (6, 4)
    assert recorder.quorum_open_in_step == [False] * 6  # inner steps never open a quorum
    assert recorder.lrs == pytest.approx([0.1 * 0.5**k for k in range(1, 7)])  # schedulers follow inner steps


def test_accumulation_counts_optimizer_steps(tmp_path):
    _, recorder = fit(tmp_path, max_steps=4, sync_every=2, accumulate_grad_batches=2)
    assert recorder.final == (4, 3)


def test_max_steps_not_a_multiple_of_sync_every_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch.lightning_ft"):
        _, recorder = fit(tmp_path, max_steps=5, sync_every=2)
    assert "max_steps=5 is not a multiple of the sync period 2" in caplog.text
    assert recorder.final == (5, 3)  # join, after 2, after 4; no final sync at 5

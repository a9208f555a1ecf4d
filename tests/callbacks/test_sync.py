"""SyncCallback reaches the fit's SyncOwner from Lightning's hooks: the owner's phases through a one-group fit, and
the callback's refusal where no sync owner exists."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer as make_trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ft import FTStrategy
from lightning_ft.algorithms.sync_owner import SyncOwner, SyncPhase
from lightning_ft.callbacks import SyncCallback
from lightning_ft.errors import StrategyRequiredError
from lightning_ft_job.events import ENV_EVENTS_DIR, read_events

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


class TwoLayers(BoringModel):
    """Two modules with parameters: two DiLoCo fragments."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))


class Phases(pl.Callback):
    """The sync owner's phase at each batch's start (after SyncCallback's hook) and after the fit's end."""

    def __init__(self) -> None:
        self.owner: SyncOwner | None = None
        self.at_batches: list[SyncPhase] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.owner = trainer.strategy.step_owner
        assert self.owner.phase is SyncPhase.NOT_JOINED

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.at_batches.append(self.owner.phase)


@pytest.mark.parametrize(("algorithm", "extra"), [("local_sgd", {}), ("diloco", {"fragments": 2})])
def test_the_owner_joins_syncs_and_ends_with_final_syncs(tmp_path, monkeypatch, algorithm, extra):
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "events"))
    phases = Phases()
    strategy = FTStrategy(algorithm=algorithm, sync_every=2, timeout=20, quorum_timeout=20, **extra)
    trainer = make_trainer(strategy, [phases], max_steps=4, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(TwoLayers())
    assert sum(isinstance(cb, SyncCallback) for cb in trainer.callbacks) == 1
    assert phases.at_batches == [SyncPhase.INNER_STEPS] * 4
    assert phases.owner.phase is SyncPhase.ENDED
    syncs = [record["sync"] for record in read_events(tmp_path / "events") if record["event"] == "step"]
    # LocalSGD: the join, after inner step 2, one final sync; DiLoCo with 2 fragments syncs one fragment every
    # sync_every / fragments = 1 inner step, and both fragments at the end.
    if algorithm == "local_sgd":
        assert syncs == ["join", "periodic", "final"]
    else:
        assert syncs == ["join", "periodic", "periodic", "periodic", "final", "final"]


def test_with_per_step_training_it_names_the_algorithms_it_needs(tmp_path):
    trainer = make_trainer(FTStrategy(), [SyncCallback()], max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(StrategyRequiredError, match="SyncCallback needs FTStrategy\\(algorithm='local_sgd'\\)"):
        trainer.fit(BoringModel())

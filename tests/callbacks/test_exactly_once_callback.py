"""ExactlyOnceDataCallback: an epoch of exactly-once data ends after the step that reads its tail, with a
``data_epoch_end`` event; with sharded data it is refused, as DataPositionCallback is with exactly-once data. (Which
samples each step reads, through kills and resumes: tests/data/test_exactly_once*.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import Regressor
from helpers import trainer as make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import FTConfigError, FTStrategy
from lightning_ft.callbacks import DataPositionCallback, ExactlyOnceDataCallback
from lightning_ft_job.events import ENV_EVENTS_DIR, read_events

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


def fit(tmp_path, monkeypatch, data_mode: str, samples: int, batch_size: int, epochs: int):
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "events"))
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size, shuffle=True)
    trainer = make_trainer(
        FTStrategy(data_mode=data_mode, timeout=20, quorum_timeout=20),
        [ExactlyOnceDataCallback()],
        max_epochs=epochs,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(scheduler=False), loader)
    ends = [record for record in read_events(tmp_path / "events") if record["event"] == "data_epoch_end"]
    return trainer, ends


@pytest.mark.parametrize(("samples", "batch_size"), [(42, 4), (40, 4), (3, 4)])
def test_each_epoch_ends_after_the_step_that_reads_its_tail(tmp_path, monkeypatch, samples, batch_size):
    trainer, ends = fit(tmp_path, monkeypatch, "exactly_once", samples, batch_size, epochs=3)
    per_epoch = -(-samples // batch_size)  # the tail is a short batch of its own
    assert trainer.global_step == 3 * per_epoch and trainer.current_epoch == 3
    assert [record["data_epoch"] for record in ends] == [0, 1, 2]


def test_with_sharded_data_it_is_refused_naming_the_setting(tmp_path, monkeypatch):
    """Sharded data has DataPositionCallback, which registers the same heal state: the two would collide in torchft
    (a bare AssertionError before this refusal)."""
    with pytest.raises(FTConfigError, match="data_mode='exactly_once'"):
        fit(tmp_path, monkeypatch, "sharded", 42, 4, epochs=1)


def test_data_position_callback_with_exactly_once_data_is_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "events"))
    x = torch.randn(8, 8)
    strategy = FTStrategy(data_mode="exactly_once", timeout=20, quorum_timeout=20)
    trainer = make_trainer(strategy, [DataPositionCallback()], max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(FTConfigError, match="Remove DataPositionCallback"):
        trainer.fit(Regressor(scheduler=False), DataLoader(TensorDataset(x, x), batch_size=4))

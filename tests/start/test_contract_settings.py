"""What the job's contract holds, and how a group decides from its peers' (``lightning_ft.start.contract``), in one
process: each setting that must agree is told apart when it alone differs, and what may differ between groups is not
in it. The processes that vote are in ``test_contract.py``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, EMAWeightAveraging, LearningRateMonitor, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import FTStrategy
from lightning_ft.start.contract import JobContractCheck
from lightning_ft.start.job_settings import JobContract, JobContractError, describe_job, strategy_contract


class TinyModel(pl.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReadContract(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.contract = describe_job(trainer, {})
        trainer.should_stop = True


def contract_of(tmp_path, *, batch_size: int = 4, hidden: int = 8, **trainer_kwargs: Any) -> JobContract:
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    reader = ReadContract()
    kwargs: dict[str, Any] = {
        "max_steps": 4,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
        **trainer_kwargs,
    }
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), reader]
    trainer = pl.Trainer(**kwargs)
    trainer.fit(TinyModel(hidden), DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=batch_size))
    return reader.contract


# Each change, and the settings it changes: some settings move another one with them (a batch size changes the
# batches per epoch; Lightning drops its default min_epochs when min_steps is given).
MUST_AGREE: list[tuple[set[str], dict[str, Any]]] = [
    ({"max_steps"}, {"max_steps": 5}),
    ({"max_epochs"}, {"max_epochs": 3}),
    ({"min_steps", "min_epochs"}, {"min_steps": 2}),
    ({"min_epochs"}, {"min_epochs": 2}),
    ({"max_time"}, {"max_time": {"seconds": 100}}),
    ({"accumulate_grad_batches"}, {"accumulate_grad_batches": 2}),
    ({"precision"}, {"precision": "bf16-mixed"}),
    ({"gradient_clip_val"}, {"gradient_clip_val": 1.0}),
    ({"gradient_clip_algorithm", "gradient_clip_val"}, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}),
    ({"train batch size", "train batches per epoch"}, {"batch_size": 8}),
    ({"train batches per epoch"}, {"limit_train_batches": 3}),
    ({"val_check_interval"}, {"val_check_interval": 2}),
    ({"check_val_every_n_epoch"}, {"check_val_every_n_epoch": 2}),
    ({"limit_val_batches"}, {"limit_val_batches": 2}),
    ({"model structure"}, {"hidden": 16}),
    ({"callbacks"}, {"callbacks": [EMAWeightAveraging(decay=0.9)]}),
    ({"callbacks"}, {"callbacks": [EarlyStopping(monitor="val_loss")]}),
]


@pytest.mark.parametrize(("settings", "change"), MUST_AGREE, ids=["-".join(sorted(c)) for _, c in MUST_AGREE])
def test_each_setting_that_must_agree_is_told_apart(tmp_path, settings, change):
    base = contract_of(tmp_path / "base")
    changed = contract_of(tmp_path / "changed", **change)
    assert {name for name, _, _ in changed.differences(base)} == settings


def test_what_may_differ_between_groups_is_not_in_the_contract(tmp_path):
    base = contract_of(tmp_path / "base")
    own = contract_of(
        tmp_path / "own",
        logger=pl.loggers.CSVLogger(tmp_path / "logs"),
        enable_progress_bar=True,
        enable_model_summary=True,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3), LearningRateMonitor()],
    )
    assert own.differences(base) == []


def test_the_strategy_s_own_settings_that_must_agree_are_in_the_contract_and_its_addresses_are_not():
    def own(**kwargs: Any) -> dict[str, Any]:
        group = {"replica_group_id": 0, "num_replica_groups": 2, "lighthouse": "http://127.0.0.1:1"}
        strategy = FTStrategy(**{**group, **kwargs})
        settings = strategy_contract(
            strategy.settings,
            strategy.algorithm,
            strategy.data_parallel,
            strategy.data_mode,
            strategy._ddp_kwargs,
            group_size=1,
        )
        return settings

    base = own()
    for change, names in [
        ({"algorithm": "local_sgd", "sync_every": 4}, {"algorithm", "sync_every", "use_async_quorum"}),
        ({"buffer_sync": "off"}, {"buffer_sync"}),
        ({"min_replica_size": 2}, {"min_replica_size"}),
        ({"bucket_cap_mb": 10}, {"bucket_cap_mb"}),
        ({"data_mode": "exactly_once"}, {"data_mode", "use_async_quorum"}),
    ]:
        changed = own(**change)
        assert {name for name in base if base[name] != changed[name]} == names, change
    for group_own in [{"timeout": 5.0}, {"hostname": "127.0.0.1"}, {"start_timeout": 1.0}, {"replica_group_id": 1}]:
        assert own(**group_own) == base, group_own


class StandInManager:
    """What the decision reads of a Manager: nothing but the committed step."""

    def current_step(self) -> int:
        return 3


def check_for(group: int, settings: dict[str, str]) -> JobContractCheck:
    return JobContractCheck(lambda: JobContract(settings), StandInManager(), group, 3, torch.device("cpu"))  # type: ignore[arg-type]


JOB = {"max_steps": "20", "precision": "'32-true'"}
EDITED = {"max_steps": "24", "precision": "'32-true'"}


def test_the_odd_group_of_a_majority_stops_naming_the_setting_and_both_values_and_the_others_go_on():
    contracts = {0: JobContract(EDITED), 1: JobContract(JOB), 2: JobContract(JOB)}
    with pytest.raises(JobContractError, match=r"replica group 0 is set up for another job than replica group\(s\) "
                       r"\[1, 2\], the majority .*: max_steps is 24 here and 20 there\."):  # fmt: skip
        check_for(0, EDITED)._decide(contracts)
    assert check_for(1, JOB)._decide(contracts) == [0]
    assert check_for(2, JOB)._decide({1: JobContract(JOB), 2: JobContract(JOB)}) == []


def test_without_a_majority_every_group_stops():
    contracts = {0: JobContract(EDITED), 1: JobContract(JOB)}
    for group, mine, here, there in [(0, EDITED, 24, 20), (1, JOB, 20, 24)]:
        with pytest.raises(JobContractError, match=f"no majority .*: max_steps is {here} here and {there} there"):
            check_for(group, mine)._decide(contracts)


def test_a_heal_from_a_running_job_with_other_settings_is_refused_and_one_at_the_job_s_start_is_left_to_the_vote():
    check = check_for(1, EDITED)
    peer = {"step": 7, "group": 0, "settings": JOB}
    with pytest.raises(JobContractError, match=r"than the running job \(it heals from replica group 0 at committed "
                       r"step 7\): max_steps is 24 here and 20 there\."):  # fmt: skip
        check.check_peer(peer)
    check.check_peer({**peer, "step": 0})  # the start's vote decides, by majority
    check.check_peer({**peer, "settings": EDITED})
    # The model's structure is named parameter by parameter by the training state's own check, which runs next.
    check_for(1, {**EDITED, "model structure": "a"}).check_peer(
        {**peer, "settings": {**EDITED, "model structure": "b"}}
    )

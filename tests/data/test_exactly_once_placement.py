"""Exactly-once data piece by piece: the schedule's arithmetic, prediction and refetch, the settings it refuses, and
one real replica group training epochs and resuming from a checkpoint (no re-read, no gap)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from lightning_ft import FTStrategy
from lightning_ft.data.placement import (
    ExactlyOnceData,
    ExactlyOnceSchedule,
    StepPlacement,
    check_data_mode,
    epoch_permutation,
    exactly_once_loader,
)
from lightning_ft.settings import FTConfigError

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------- the schedule
def test_the_ranks_of_a_group_split_each_group_batch_and_an_epoch_covers_the_permutation_once():
    ranks = [ExactlyOnceSchedule(64, batch_size=4, group_size=2, group_rank=r, seed=3) for r in range(2)]
    assert ranks[0].batches_per_epoch == 8
    read = [i for g in range(8) for schedule in ranks for i in schedule.indices(g)]
    assert read == epoch_permutation(64, 0, seed=3).tolist()
    second_epoch = [i for g in range(8, 16) for schedule in ranks for i in schedule.indices(g)]
    assert second_epoch == epoch_permutation(64, 1, seed=3).tolist() != read


@pytest.mark.parametrize(
    ("samples", "drop_last", "tail_sizes"),
    [
        pytest.param(42, False, [1, 1], id="a-tail-of-2-split-over-2-ranks"),
        pytest.param(45, False, [3, 2], id="a-tail-of-5-split-unevenly"),
        pytest.param(41, False, None, id="a-tail-smaller-than-the-group-is-dropped"),
        pytest.param(45, True, None, id="drop_last-drops-the-tail"),
    ],
)
def test_the_last_group_batch_of_an_epoch(samples, drop_last, tail_sizes):
    ranks = [ExactlyOnceSchedule(samples, 4, 2, r, shuffle=False, drop_last=drop_last) for r in range(2)]
    assert ranks[0].batches_per_epoch == 5 + (tail_sizes is not None)
    if tail_sizes is not None:
        tail = [schedule.indices(5) for schedule in ranks]
        assert [len(part) for part in tail] == tail_sizes
        assert tail[0] + tail[1] == list(range(40, samples))
    assert ranks[0].indices(ranks[0].batches_per_epoch) == [0, 1, 2, 3]  # the next epoch starts over


def test_a_step_reads_by_participating_rank_and_ends_the_epoch_when_it_consumes_its_last_group_batch():
    schedule = ExactlyOnceSchedule(32, 4, shuffle=False)  # 8 group batches per epoch
    assert schedule.step_indices(StepPlacement(cursor=5, participants=3, participating_rank=2)) == [28, 29, 30, 31]
    assert schedule.step_indices(StepPlacement(cursor=5, participants=3, participating_rank=None)) is None
    assert not schedule.ends_epoch(StepPlacement(cursor=4, participants=3, participating_rank=0))
    assert schedule.ends_epoch(StepPlacement(cursor=5, participants=3, participating_rank=0))  # reaches 8 exactly
    assert schedule.ends_epoch(StepPlacement(cursor=7, participants=2, participating_rank=0))  # crosses it
    assert schedule.step_indices(StepPlacement(7, 2, 1)) == [0, 1, 2, 3]  # epoch 1's first group batch


def test_a_dataset_smaller_than_a_group_batch_is_refused():
    with pytest.raises(FTConfigError, match="smaller batch_size"):
        ExactlyOnceSchedule(7, batch_size=4, group_size=2, drop_last=True)


# ---------------------------------------------------------------------------------------------- predict, refetch
class Ids(Dataset):
    def __init__(self, size: int = 64) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), float(index) / self.size), index


def collate(samples: list[tuple[torch.Tensor, int]]) -> list[int]:
    return [index for _, index in samples]


def data(participants: int = 2, rank: int | None = 0, committed: int = 0) -> ExactlyOnceData:
    schedule = ExactlyOnceSchedule(64, 4, shuffle=False)
    return ExactlyOnceData(schedule, Ids(), collate, participants, rank, lambda: committed)


def test_predictions_follow_the_membership_until_it_changes_and_a_wrong_one_is_refetched():
    eo = data(participants=2, rank=1, committed=6)
    assert [eo.predict_next(), eo.predict_next()] == [[28, 29, 30, 31], [36, 37, 38, 39]]  # cursors 6 and 8
    batch, refetched = eo.batch_for_step("loaded", StepPlacement(6, 2, 1))
    assert (batch, refetched) == ("loaded", False)
    # The next step's quorum finds a third group: the batch loaded ahead (cursor 8, rank 1) is wrong.
    batch, refetched = eo.batch_for_step("loaded", StepPlacement(8, 3, 2))
    assert (batch, refetched) == ([40, 41, 42, 43], True)
    assert eo.predict_next() == [52, 53, 54, 55]  # cursor 11, participating rank 2
    assert eo.refetches == 1 and eo.steps == 2


def test_a_step_that_did_not_commit_is_read_again_by_the_next_attempt():
    eo = data(participants=1, rank=0)
    eo.predict_next()
    eo.batch_for_step("loaded", StepPlacement(0, 1, 0))
    eo.predict_next()  # predicts cursor 1
    batch, refetched = eo.batch_for_step("loaded", StepPlacement(0, 1, 0))  # step 0 did not commit
    assert (batch, refetched) == ([0, 1, 2, 3], True)


def test_a_group_that_does_not_contribute_keeps_the_batch_it_loaded():
    eo = data()
    eo.predict_next()
    assert eo.batch_for_step("loaded", StepPlacement(0, 2, None)) == ("loaded", False)


def test_a_new_iterator_forgets_what_the_last_one_loaded_ahead():
    eo = data(participants=1)
    eo.predict_next()
    eo.forget_predictions()
    assert eo.predict_next() == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- settings
def test_the_settings_exactly_once_cannot_work_with_are_refused():
    assert check_data_mode("sharded", "ddp", True) is None
    assert check_data_mode("exactly_once", "ddp", False) is None
    with pytest.raises(FTConfigError, match="data_mode='exact'"):
        check_data_mode("exact", "ddp", False)
    with pytest.raises(FTConfigError, match="use_async_quorum"):
        FTStrategy(data_mode="exactly_once", use_async_quorum=True)
    with pytest.raises(FTConfigError, match="algorithm='diloco'"):
        FTStrategy(data_mode="exactly_once", algorithm="diloco", sync_every=4)
    assert FTStrategy(data_mode="exactly_once").settings.use_async_quorum is False


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


class EveryOther(Sampler[int]):
    def __iter__(self):
        yield from range(0, 64, 2)

    def __len__(self) -> int:
        return 32


@pytest.mark.parametrize(
    ("loader", "fix"),
    [
        pytest.param(DataLoader(Stream(), batch_size=2), "IterableDataset", id="iterable-dataset"),
        pytest.param(DataLoader(Ids(), batch_sampler=[[0, 1]]), "Remove the batch_sampler", id="batch-sampler"),
        pytest.param(DataLoader(Ids(), batch_size=4, sampler=EveryOther()), "EveryOther", id="custom-sampler"),
        pytest.param([[0, 1]], "needs a torch DataLoader", id="not-a-dataloader"),
    ],
)
def test_loaders_exactly_once_cannot_follow_are_refused_with_the_fix(loader, fix):
    with pytest.raises(FTConfigError, match=fix):
        exactly_once_loader(loader, 1, 0, 1, 0, lambda: 0)


def test_the_rebuilt_loader_keeps_the_users_settings():
    original = DataLoader(Ids(), batch_size=4, shuffle=True, collate_fn=collate, drop_last=True)
    loader, eo = exactly_once_loader(original, 1, 0, 1, 0, lambda: 0)
    assert loader.collate_fn is collate and eo.schedule.shuffle and eo.schedule.batch_size == 4
    assert next(iter(loader)) == epoch_permutation(64, 0)[:4].tolist()


# ---------------------------------------------------------------------------------------------- one real group
class RecordIds(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.seen: dict[int, tuple[int, list[int]]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, ids = batch
        self.seen[self.trainer.global_step + 1] = (self.trainer.current_epoch, ids.tolist())
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(max_steps: int, ckpt_dir: Path | None = None, ckpt_path: str | None = None, **kwargs: Any) -> RecordIds:
    callbacks = [] if ckpt_dir is None else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=14, save_top_k=-1)]
    model = RecordIds()
    run = trainer(
        strategy=FTStrategy(data_mode="exactly_once"),
        callbacks=callbacks,
        max_steps=max_steps,
        enable_checkpointing=ckpt_dir is not None,
        **kwargs,
    )
    run.fit(model, DataLoader(Ids(42), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return model


def test_each_epoch_reads_its_permutation_once_and_ends_after_the_tail():
    """42 samples in batches of 4: 10 full batches and a tail of 2 per epoch."""
    seen = fit(max_steps=-1, max_epochs=3).seen
    assert len(seen) == 33
    for epoch in range(3):
        ids = [i for e, batch in seen.values() if e == epoch for i in batch]
        assert ids == epoch_permutation(42, epoch).tolist()


def test_a_resumed_fit_reads_on_from_the_committed_position(tmp_path):
    uninterrupted = fit(max_steps=24).seen
    fit(max_steps=14, ckpt_dir=tmp_path)
    resumed = fit(max_steps=24, ckpt_path=str(tmp_path / "epoch=1-step=14.ckpt")).seen
    assert sorted(resumed) == list(range(15, 25))
    assert resumed == {step: uninterrupted[step] for step in range(15, 25)}


def test_accumulation_is_refused_with_the_fix():
    with pytest.raises(FTConfigError, match="accumulate_grad_batches=1"):
        fit(max_steps=2, accumulate_grad_batches=2)


def test_with_stable_membership_every_prediction_holds_and_the_monitor_reports_no_refetch():
    from lightning_ft.callbacks import FaultToleranceMonitor

    reported: list[float] = []

    class ReadMetrics(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            reported.append(FaultToleranceMonitor.metrics(trainer)["ft/data_refetches"])

    model = RecordIds()
    strategy = FTStrategy(data_mode="exactly_once", num_replica_groups=1, replica_group_id=0)
    run = trainer(strategy=strategy, callbacks=[ReadMetrics()], max_steps=15)
    # A worker loads prefetch_factor batches ahead. Spawned, not forked: this process runs torchft's threads.
    loader = DataLoader(Ids(42), batch_size=4, shuffle=True, num_workers=1, multiprocessing_context="spawn")
    run.fit(model, loader)
    assert reported == [0.0] * 15

"""Each group's data position, piece by piece: counter shifting, iterator repositioning, the per-rank sidecars
beside checkpoints, and a resumed fit on one real replica group reading exactly the batches an uninterrupted one
reads."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_ft import FTStrategy
from lightning_ft.callbacks import DataPositionCallback, QuorumCallback
from lightning_ft.data.position import (
    LoopPosition,
    align_with_peer,
    iterator_position,
    reposition_fetcher,
    shift_batch_progress,
)
from lightning_ft.data.sidecars import (
    remove_sidecars,
    save_own_position,
    sidecar_dir,
    sidecar_path,
    use_own_position,
    write_sidecar,
)

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------- counters
def progress(ready: int, started: int, processed: int, completed: int, before_epoch: int = 0) -> _BatchProgress:
    bp = _BatchProgress()
    bp.current.ready, bp.current.started, bp.current.processed, bp.current.completed = (
        ready,
        started,
        processed,
        completed,
    )
    bp.total.ready, bp.total.started, bp.total.processed, bp.total.completed = (
        n + before_epoch for n in (ready, started, processed, completed)
    )
    return bp


def counters(bp: _BatchProgress) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(
        (tracker.ready, tracker.started, tracker.processed, tracker.completed) for tracker in (bp.current, bp.total)
    )


def test_shift_moves_every_counter_by_the_same_amount():
    bp = progress(ready=1, started=1, processed=0, completed=0)
    shift_batch_progress(bp, current_delta=6, total_delta=26)
    assert counters(bp) == ((7, 7, 6, 6), (27, 27, 26, 26))


@pytest.mark.parametrize(
    ("phase", "expected_current"),
    [
        # synchronous quorum: the heal comes inside on_train_batch_start, before `started` is counted
        pytest.param((1, 0, 0, 0), (8, 7, 7, 7), id="sync-quorum"),
        # asynchronous quorum: inside the commit vote, after `started`, before `processed`
        pytest.param((1, 1, 0, 0), (8, 8, 7, 7), id="async-quorum"),
    ],
)
def test_heal_takes_the_peers_position_and_keeps_its_own_phase(phase, expected_current):
    """A restarted group at its first batch heals from a peer whose step began at batch 8 of epoch 3 (38 batches
    into the fit). Its ``ready`` counters become the peer's; the rest keep their offsets to ``ready``."""
    bp = progress(*phase)
    own = LoopPosition(epoch=0, current_ready=1, total_ready=1)
    peer = LoopPosition(epoch=3, current_ready=8, total_ready=38)
    align_with_peer(bp, own, peer)
    assert counters(bp)[0] == expected_current
    assert counters(bp)[1] == tuple(n + 30 for n in expected_current)
    assert (bp.current.ready, bp.total.ready) == (peer.current_ready, peer.total_ready)


def test_heal_with_accumulation_aligns_the_step_starts():
    """With accumulation and asynchronous quorum the healing group heals at the last micro-batch of its step, while
    the peer's position is that of the first micro-batch of the same step: the step starts are what line up."""
    bp = progress(ready=2, started=2, processed=1, completed=1)  # second of two micro-batches
    align_with_peer(bp, LoopPosition(0, 1, 1), LoopPosition(2, 5, 25))
    assert (bp.current.ready, bp.total.ready) == (6, 26)  # the peer's second micro-batch of that step


def test_loop_position_round_trips_as_plain_data():
    position = LoopPosition(epoch=2, current_ready=5, total_ready=21)
    assert LoopPosition.from_dict(position.as_dict()) == position
    assert all(type(value) is int for value in position.as_dict().values())  # loadable with weights_only=True


# ---------------------------------------------------------------------------------------------- the iterator
SIZE, BATCH = 64, 4  # two shards of 32 samples: 8 batches per epoch


def shard(rank: int, epoch: int) -> list[list[int]]:
    sampler = DistributedSampler(range(SIZE), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


def fetcher_at(epoch: int, batches_read: int, rank: int = 1) -> tuple[_PrefetchDataFetcher, DataLoader]:
    loader = DataLoader(
        list(range(SIZE)),
        batch_size=BATCH,
        sampler=DistributedSampler(range(SIZE), num_replicas=2, rank=rank, shuffle=True, seed=0),
    )
    loader.sampler.set_epoch(epoch)
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    for _ in range(batches_read):
        next(fetcher)
    return fetcher, loader


def next_ids(fetcher: _PrefetchDataFetcher) -> list[int]:
    batch, _, _ = next(fetcher)
    return batch.tolist()


def test_same_epoch_reads_forward_to_the_peers_next_batch():
    fetcher, loader = fetcher_at(epoch=0, batches_read=1)  # the batch in flight at the heal
    how = reposition_fetcher(fetcher, [loader], iterator_epoch=0, target_epoch=0, target_position=5)
    assert how == "forward"
    assert fetcher.fetched == 5  # Lightning's count of batches read this epoch stays right
    assert next_ids(fetcher) == shard(1, 0)[5]


def test_another_epoch_restarts_the_iterator_in_that_epoch():
    fetcher, loader = fetcher_at(epoch=0, batches_read=1)
    how = reposition_fetcher(fetcher, [loader], iterator_epoch=0, target_epoch=3, target_position=2)
    assert how == "restart"
    assert loader.sampler.epoch == 3
    assert fetcher.fetched == 2
    assert [next_ids(fetcher) for _ in range(6)] == shard(1, 3)[2:]
    assert fetcher.done  # the epoch's last batch is still recognised


def test_behind_in_the_same_epoch_restarts_the_iterator():
    fetcher, loader = fetcher_at(epoch=2, batches_read=6)
    how = reposition_fetcher(fetcher, [loader], iterator_epoch=2, target_epoch=2, target_position=3)
    assert how == "restart"
    assert next_ids(fetcher) == shard(1, 2)[3]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(20))


def test_a_prefetching_fetcher_counts_the_batch_it_read_ahead():
    """Without a length, Lightning's fetcher reads one batch ahead to know which batch is the last."""
    fetcher = _PrefetchDataFetcher()
    loader = DataLoader(Stream(), batch_size=2)
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    assert (fetcher.fetched, iterator_position(fetcher)) == (1, 0)
    reposition_fetcher(fetcher, [loader], iterator_epoch=0, target_epoch=0, target_position=4)
    assert next_ids(fetcher) == [8, 9]


# ---------------------------------------------------------------------------------------------- sidecars
def checkpoint_at(step: int, loader_state: Any = None, current: int = 3, total: int = 13) -> dict[str, Any]:
    batch_progress = {
        "current": {"ready": current, "started": current, "processed": current, "completed": current - 1},
        "total": {"ready": total, "started": total, "processed": total, "completed": total - 1},
        "is_last_batch": False,
    }
    state_dict: dict[str, Any] = {}
    if loader_state is not None:
        state_dict["combined_loader"] = [loader_state]
    return {
        "global_step": step,
        "epoch": 1,
        "loops": {"fit_loop": {"state_dict": state_dict, "epoch_loop.batch_progress": batch_progress}},
    }


def loader_state_in(checkpoint: dict[str, Any]) -> Any:
    return checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")


def test_each_rank_writes_its_own_sidecar_and_resumes_from_it(tmp_path):
    path = tmp_path / "last.ckpt"
    for group in (0, 1):
        save_own_position(
            checkpoint_at(10, {"group": group}), path, replica_group_id=group, group_rank=0, is_writer=False
        )
    assert sorted(p.name for p in Path(sidecar_dir(path)).iterdir()) == ["group0.rank0.pt", "group1.rank0.pt"]

    loaded = checkpoint_at(10, {"group": 0})  # the main file holds the writer's (group 0's) loader state
    assert use_own_position(loaded, path, replica_group_id=1, group_rank=0) == "loader_state"
    assert loader_state_in(loaded) == [{"group": 1}]


def test_without_a_sidecar_the_writers_loader_state_is_dropped(tmp_path, caplog):
    loaded = checkpoint_at(10, {"group": 0})
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.lightning_ft"):
        assert use_own_position(loaded, tmp_path / "last.ckpt", replica_group_id=1, group_rank=0) == "counting"
    assert loader_state_in(loaded) is None
    assert "group1.rank0.pt" in caplog.text


def test_a_sidecar_from_another_step_is_ignored(tmp_path, caplog):
    path = tmp_path / "last.ckpt"
    save_own_position(checkpoint_at(10, {"group": 1}), path, replica_group_id=1, group_rank=0, is_writer=False)
    loaded = checkpoint_at(20, {"group": 0})
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch.lightning_ft"):
        assert use_own_position(loaded, path, replica_group_id=1, group_rank=0) == "counting"
    assert loader_state_in(loaded) is None
    assert "saved at step 10, the checkpoint at step 20" in caplog.text


def test_a_sidecar_at_another_position_is_ignored(tmp_path, caplog):
    path = tmp_path / "last.ckpt"
    save_own_position(
        checkpoint_at(10, {"group": 1}, current=4, total=14), path, replica_group_id=1, group_rank=0, is_writer=False
    )
    loaded = checkpoint_at(10, {"group": 0})
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch.lightning_ft"):
        assert use_own_position(loaded, path, replica_group_id=1, group_rank=0) == "counting"
    assert loader_state_in(loaded) is None
    assert "(1, 4, 14)" in caplog.text


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"PK\x03\x04 truncated zip"])
def test_an_unreadable_sidecar_falls_back_to_counting_and_says_which_file(tmp_path, caplog, content):
    path = tmp_path / "last.ckpt"
    broken = Path(sidecar_path(path, 1, 0))
    broken.parent.mkdir()
    broken.write_bytes(content)
    loaded = checkpoint_at(10, {"group": 0})
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch.lightning_ft"):
        assert use_own_position(loaded, path, replica_group_id=1, group_rank=0) == "counting"
    assert loader_state_in(loaded) is None
    assert str(broken) in caplog.text and "Delete the file" in caplog.text


def test_the_writer_keeps_its_position_in_the_checkpoint_and_reads_it_back_without_a_sidecar(tmp_path):
    """A one-process job's checkpoint folder holds no ``.data`` folder: the writer's position is the checkpoint's own,
    marked as the writer's; another rank reading it still drops it (it is another shard's)."""
    path = tmp_path / "last.ckpt"
    checkpoint = checkpoint_at(10, {"group": 1})
    save_own_position(checkpoint, path, replica_group_id=1, group_rank=0, is_writer=True)
    assert not Path(sidecar_dir(path)).exists()
    assert use_own_position(copy.deepcopy(checkpoint), path, replica_group_id=1, group_rank=0) == "loader_state"
    other = copy.deepcopy(checkpoint)
    assert use_own_position(other, path, replica_group_id=0, group_rank=0) == "counting"
    assert loader_state_in(other) is None


def test_a_sidecar_without_loader_state_means_counting(tmp_path):
    path = tmp_path / "last.ckpt"
    save_own_position(checkpoint_at(10), path, replica_group_id=1, group_rank=0)
    loaded = checkpoint_at(10, {"group": 0})
    assert use_own_position(loaded, path, replica_group_id=1, group_rank=0) == "counting"
    assert loader_state_in(loaded) is None


def test_a_linked_last_checkpoint_uses_the_sidecars_of_its_target(tmp_path):
    target = tmp_path / "epoch=1-step=10.ckpt"
    save_own_position(checkpoint_at(10, {"group": 1}), target, replica_group_id=1, group_rank=0)
    os.symlink(target.name, tmp_path / "last.ckpt")
    loaded = checkpoint_at(10, {"group": 0})
    assert use_own_position(loaded, tmp_path / "last.ckpt", replica_group_id=1, group_rank=0) == "loader_state"
    assert loader_state_in(loaded) == [{"group": 1}]


def test_removing_a_checkpoints_sidecars_leaves_the_others(tmp_path):
    old, new = tmp_path / "step=10.ckpt", tmp_path / "step=20.ckpt"
    for path in (old, new):
        save_own_position(checkpoint_at(10), path, replica_group_id=0, group_rank=0)
    remove_sidecars(old)
    remove_sidecars(tmp_path / "never-saved.ckpt")  # nothing there: no error
    assert not Path(sidecar_dir(old)).exists()
    assert Path(sidecar_path(new, 0, 0)).exists()


def test_a_write_sweeps_only_its_own_leftovers(tmp_path):
    """Ranks of several groups write into the same sidecar directory at the same time."""
    target = Path(sidecar_path(tmp_path / "last.ckpt", 1, 0))
    target.parent.mkdir()
    own_leftover = target.parent / f".{target.name}.killed.partial"
    others_in_progress = target.parent / ".group0.rank0.pt.writing.partial"
    own_leftover.touch()
    others_in_progress.touch()
    write_sidecar({"format": 1}, str(target))
    assert target.exists() and not own_leftover.exists() and others_in_progress.exists()


def test_the_strategy_writes_removes_and_splices_the_sidecars(tmp_path):
    """Group 0 rank 0 writes the checkpoint, its own position inside; group 1 (outside fitting, not the writer) writes
    its sidecar beside it, and each reads back its own."""
    lighthouse = "http://127.0.0.1:1"  # never contacted outside fitting
    writer = FTStrategy(replica_group_id=0, num_replica_groups=2, lighthouse=lighthouse)  # group 0 rank 0 writes
    other = FTStrategy(replica_group_id=1, num_replica_groups=2, lighthouse=lighthouse)
    path = tmp_path / "step=10.ckpt"
    other.save_checkpoint(checkpoint_at(10, {"group": 1}), path)
    writer.save_checkpoint(checkpoint_at(10, {"group": 0}), path)
    assert path.exists() and not Path(sidecar_path(path, 0, 0)).exists() and Path(sidecar_path(path, 1, 0)).exists()
    assert loader_state_in(writer.load_checkpoint(path)) == [{"group": 0}]
    assert loader_state_in(other.load_checkpoint(path)) == [{"group": 1}]
    writer.remove_checkpoint(path)
    assert not path.exists() and not Path(sidecar_dir(path)).exists()


# ---------------------------------------------------------------------------------------------- resume, one group
class Indexed(Dataset):
    def __len__(self) -> int:
        return 40  # 10 batches of 4 per epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), float(index) / 40), index


class RecordIds(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.seen: dict[int, tuple[int, int, list[int]]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, ids = batch
        self.seen[self.trainer.global_step + 1] = (self.trainer.current_epoch, batch_idx, ids.tolist())
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


LOADERS = ("plain", "stateful", "stateful-torch-sampler")


def train_loader(kind: str) -> DataLoader:
    """A plain DataLoader (Lightning installs its DistributedSampler), or a StatefulDataLoader with torchdata's
    stateful sampler or with torch's DistributedSampler (whose order is fixed when its iterator is made)."""
    if kind == "plain":
        return DataLoader(Indexed(), batch_size=4, shuffle=True)
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    sampler_class = StatefulDistributedSampler if kind == "stateful" else DistributedSampler
    sampler = sampler_class(Indexed(), num_replicas=1, rank=0, shuffle=True, seed=0)
    return StatefulDataLoader(Indexed(), batch_size=4, sampler=sampler)


def fit(kind: str, max_steps: int, ckpt_dir: Path | None = None, ckpt_path: str | None = None) -> RecordIds:
    callbacks = [] if ckpt_dir is None else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=14, save_top_k=-1)]
    model = RecordIds()
    run = trainer(
        strategy=FTStrategy(),
        callbacks=callbacks,
        max_steps=max_steps,
        enable_checkpointing=ckpt_dir is not None,
        use_distributed_sampler=kind == "plain",
    )
    run.fit(model, train_loader(kind), ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, dict[int, tuple[int, int, list[int]]]]:
    return {kind: fit(kind, max_steps=24).seen for kind in LOADERS}


@pytest.mark.parametrize(
    ("kind", "drop_sidecar"),
    [
        pytest.param("plain", False, id="plain-counting"),
        pytest.param("stateful", False, id="stateful-loader-state"),
        pytest.param("stateful-torch-sampler", False, id="stateful-torch-sampler-loader-state"),
        pytest.param("stateful", True, id="stateful-without-sidecar-counting"),
    ],
)
def test_a_resumed_fit_reads_what_an_uninterrupted_one_reads(tmp_path, uninterrupted, kind, drop_sidecar):
    """Step 14 ends at batch 4 of epoch 1. Lightning alone would replay epoch 1 from its start with a plain
    DataLoader, and read epoch 0's order with a StatefulDataLoader over torch's DistributedSampler (its iterator
    is made before the sampler's epoch is set)."""
    fit(kind, max_steps=14, ckpt_dir=tmp_path)
    checkpoint = tmp_path / "epoch=1-step=14.ckpt"
    if drop_sidecar:
        remove_sidecars(checkpoint)
    resumed = fit(kind, max_steps=24, ckpt_path=str(checkpoint)).seen
    assert sorted(resumed) == list(range(15, 25))
    assert resumed == {step: uninterrupted[kind][step] for step in range(15, 25)}


class StepStarts(pl.Callback):
    """At each batch end: the position the data callback holds as its optimizer step's start."""

    def __init__(self, data_position: DataPositionCallback) -> None:
        self.data_position = data_position
        self.starts: list[int | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        start = self.data_position._step_start
        self.starts.append(None if start is None else start.total_ready)


@pytest.mark.parametrize("quorum_first", [True, False], ids=["quorum-callback-first", "data-callback-first"])
def test_each_steps_start_is_recorded_whatever_the_callback_order(quorum_first):
    """The step's starting position is what a heal sends; it is taken as the step's quorum opens, so a
    ``QuorumCallback`` placed before the data callback (which once had to come first, and recorded nothing
    otherwise) still leaves every step's first micro-batch on record. With accumulation 2, batches 1-2 are step 1."""
    data_position = DataPositionCallback()
    starts = StepStarts(data_position)
    callbacks = [QuorumCallback(), data_position] if quorum_first else [data_position, QuorumCallback()]
    run = trainer(strategy=FTStrategy(), callbacks=[*callbacks, starts], max_steps=3, accumulate_grad_batches=2)
    run.fit(RecordIds(), train_loader("plain"))
    assert starts.starts == [1, 1, 3, 3, 5, 5]

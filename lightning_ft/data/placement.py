"""Exactly-once data: every committed step reads the next samples of one job-wide permutation.

The default data mode (``data_mode="sharded"``) gives each replica group a fixed shard, as torchft's own
``DistributedSampler`` does. That is lossy: while a group is dead nobody reads its shard, and what it reads after a heal
depends on where it was. ``data_mode="exactly_once"`` instead derives what each rank reads from the committed state:

* Each epoch has one permutation of the dataset (:func:`epoch_permutation`), the same in every group.
* The permutation is cut into *group batches* of ``group size × batch_size`` samples. A step whose quorum formed
  after ``batches_committed`` group batches (torchft's counter: the participants of every committed step, summed)
  gives group batch ``batches_committed + participating rank`` to each participating group, and each rank of the
  group takes its ``batch_size`` slice of it. A committed step therefore consumes exactly the next
  ``participants`` group batches; a step that does not commit consumes nothing, and the next attempt reads the same
  ones, in whatever membership it then has.
* ``batches_committed`` travels with torchft's own state on a heal and in Lightning checkpoints
  (:class:`~lightning_ft.callbacks.ManagerCheckpointCallback`), so the position survives both.

The price is that a step's data is only known once its quorum has formed (so the quorum must be synchronous), while
Lightning and the ``DataLoader`` workers load batches ahead of time. :class:`PredictingBatchSampler` therefore loads
the batches the coming steps *will* read if they all commit with the current membership; when the quorum says
otherwise (a group died or joined, a step did not commit), :meth:`ExactlyOnceData.batch_for_step` reads the right
samples in the training process instead (a *refetch*; counted, and measured in ``docs/benchmarks.md``).

An epoch ends after the committed step that reaches the end of its permutation, decided from the committed state
alone, so every group ends it at the same step (:meth:`ExactlyOnceSchedule.ends_epoch`). A step that crosses the end
gives the groups after the boundary the first samples of the next epoch's permutation. Within an epoch no sample is
skipped and none is read twice; only a last group batch smaller than the group size is dropped.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_ft import lightning_internals
from lightning_ft.settings import DATA_MODES, FTConfigError

log = logging.getLogger("lightning.pytorch.lightning_ft")


def epoch_permutation(num_samples: int, epoch: int, seed: int = 0, shuffle: bool = True) -> torch.Tensor:
    """The order in which an epoch reads the dataset: the same in every group, a function of the epoch only."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


@dataclass(frozen=True)
class StepPlacement:
    """Where one step reads in the data: known once its quorum has formed.

    Attributes:
        cursor: Group batches consumed by committed steps before this one (torchft's ``batches_committed``).
        participants: Groups that contribute to this step.
        participating_rank: This group's rank among them; ``None`` when it does not contribute (a hot spare).
    """

    cursor: int
    participants: int
    participating_rank: int | None

    @property
    def next_cursor(self) -> int:
        """The cursor after this step, if it commits."""
        return self.cursor + self.participants


class ExactlyOnceSchedule:
    """Which samples a rank reads for a given group batch. Pure arithmetic: the same answer in every process.

    Args:
        num_samples: The dataset's length.
        batch_size: Samples per rank per step (the ``DataLoader``'s ``batch_size``).
        group_size: Processes in a replica group.
        group_rank: This process's rank in its group.
        shuffle: Read each epoch in a seeded random order (else in index order).
        seed: Seed of the permutations (epoch ``e`` uses ``seed + e``).
        drop_last: Drop a last group batch that is smaller than ``group size × batch_size``. Without it, the last
            group batch is split across the group's ranks as evenly as possible (dropped only when it is smaller
            than the group size, as some rank would get nothing).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        group_size: int = 1,
        group_rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.group_size = group_size
        self.group_rank = group_rank
        self.shuffle = shuffle
        self.seed = seed
        self.group_batch = batch_size * group_size
        self.full_batches, remainder = divmod(num_samples, self.group_batch)
        self.tail = remainder if not drop_last and remainder >= group_size else 0
        self.batches_per_epoch = self.full_batches + (1 if self.tail else 0)
        if self.batches_per_epoch == 0:
            raise FTConfigError(
                f"data_mode='exactly_once': the dataset has {num_samples} samples, fewer than one group batch "
                f"({group_size} ranks × batch_size {batch_size}). Use a smaller batch_size."
            )
        self._cached: tuple[int, torch.Tensor] | None = None

    def epoch_of(self, group_batch: int) -> int:
        return group_batch // self.batches_per_epoch

    def order(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.num_samples, epoch, self.seed, self.shuffle))
        return self._cached[1]

    def indices(self, group_batch: int) -> list[int]:
        """This rank's samples in group batch number ``group_batch`` (counted from the start of training)."""
        epoch, position = divmod(group_batch, self.batches_per_epoch)
        start = position * self.group_batch
        if position < self.full_batches:
            low = start + self.group_rank * self.batch_size
            high = low + self.batch_size
        else:  # the partial last group batch, split as evenly as possible
            share, extra = divmod(self.tail, self.group_size)
            low = start + self.group_rank * share + min(self.group_rank, extra)
            high = low + share + (1 if self.group_rank < extra else 0)
        return self.order(epoch)[low:high].tolist()

    def step_indices(self, placement: StepPlacement) -> list[int] | None:
        """This rank's samples in a step; ``None`` for a group that does not contribute to it."""
        if placement.participating_rank is None:
            return None
        return self.indices(placement.cursor + placement.participating_rank)

    def ends_epoch(self, placement: StepPlacement) -> bool:
        """Whether the epoch ends after this step, if it commits: it consumed the epoch's last group batch."""
        return self.epoch_of(placement.next_cursor) > self.epoch_of(placement.cursor)


class PredictingBatchSampler(Sampler[list[int]]):
    """Yields the samples of the coming steps as predicted by :class:`ExactlyOnceData`. Never ends by itself: the
    epoch ends after the committed step that finishes the permutation (see :meth:`ExactlyOnceSchedule.ends_epoch`),
    so it has no length (Lightning then counts batches without a total)."""

    def __init__(self, data: ExactlyOnceData) -> None:
        self._data = data

    def __iter__(self) -> Iterator[list[int]]:
        self._data.forget_predictions()  # a new iterator: what the last one loaded ahead is dropped
        while True:
            yield self._data.predict_next()


class ExactlyOnceData:
    """The training process's side of exactly-once data: predicting, checking and refetching batches.

    Args:
        schedule: What each group batch holds for this rank.
        dataset: The map-style dataset, read directly for a refetch.
        collate_fn: The loader's ``collate_fn``, for a refetch.
        participants_guess: How many groups to expect before the first quorum (``num_replica_groups``, or
            ``min_replica_size`` with hot spares).
        rank_guess: This group's expected participating rank before the first quorum.
        committed: torchft's ``batches_committed`` at the start (non-zero after a resume).
    """

    def __init__(
        self,
        schedule: ExactlyOnceSchedule,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any],
        participants_guess: int,
        rank_guess: int | None,
        committed: Callable[[], int],
    ) -> None:
        self.schedule = schedule
        self._dataset = dataset
        self._collate_fn = collate_fn
        self._committed = committed
        self._participants = participants_guess
        self._rank = rank_guess
        self._next_cursor: int | None = None  # None: read `committed()` when the first prediction is made
        self._predicted: collections.deque[list[int]] = collections.deque()
        self.last_placement: StepPlacement | None = None
        self.refetches = 0
        self.steps = 0

    # ------------------------------------------------------------------ loading ahead
    def forget_predictions(self) -> None:
        self._predicted.clear()

    def predict_next(self) -> list[int]:
        """The samples of the step after the ones already loaded ahead, if all of them commit as things stand."""
        if self._next_cursor is None:
            self._next_cursor = self._committed()
        cursor = self._next_cursor + len(self._predicted) * self._participants
        indices = self.schedule.indices(cursor + (self._rank or 0))
        self._predicted.append(indices)
        return indices

    # ------------------------------------------------------------------ the step
    def batch_for_step(self, batch: Any, placement: StepPlacement) -> tuple[Any, bool]:
        """The batch this rank must train on now that the step's quorum has formed, and whether it was refetched.

        ``batch`` is what the loader produced for the oldest prediction. A group that does not contribute keeps it
        (its gradient is zeroed in the average, so which samples it holds does not matter).
        """
        predicted = self._predicted.popleft() if self._predicted else None
        self._participants = placement.participants
        self._rank = placement.participating_rank
        self._next_cursor = placement.next_cursor
        self.last_placement = placement
        self.steps += 1
        wanted = self.schedule.step_indices(placement)
        if wanted is None or wanted == predicted:
            return batch, False
        self.refetches += 1
        return self.fetch(wanted), True

    def fetch(self, indices: list[int]) -> Any:
        """Read samples as a ``DataLoader`` without workers would (``__getitems__`` when the dataset has it)."""
        getitems = getattr(self._dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self._dataset[index] for index in indices]
        return self._collate_fn(samples)


def exactly_once_loader(
    dataloader: object,
    group_size: int,
    group_rank: int,
    participants_guess: int,
    rank_guess: int | None,
    committed: Callable[[], int],
) -> tuple[DataLoader, ExactlyOnceData]:
    """The user's training ``DataLoader`` rebuilt around a :class:`PredictingBatchSampler`, keeping its dataset,
    ``batch_size``, ``collate_fn``, workers and memory settings, and the :class:`ExactlyOnceData` that drives it.
    The order comes from the sampler Lightning or the user put in: shuffled (``DistributedSampler``'s seed, else 0)
    or sequential.

    Raises:
        FTConfigError: for what exactly-once data cannot do, naming the fix.
    """
    if not isinstance(dataloader, DataLoader):
        raise FTConfigError(
            f"data_mode='exactly_once' needs a torch DataLoader as the training dataloader, got "
            f"{type(dataloader).__name__}. Return a DataLoader, or use data_mode='sharded'."
        )
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise FTConfigError(
            "data_mode='exactly_once' needs a map-style dataset with __len__ (it draws one permutation of it per "
            "epoch); this DataLoader reads an IterableDataset. Use data_mode='sharded'."
        )
    if dataloader.batch_size is None:
        raise FTConfigError(
            "data_mode='exactly_once' needs DataLoader(batch_size=...): it makes its own batches from one permutation "
            "per epoch, so a custom batch_sampler cannot be used. Remove the batch_sampler, or use data_mode='sharded'."
        )
    if not getattr(dataloader, "in_order", True):
        raise FTConfigError("data_mode='exactly_once' needs DataLoader(in_order=True) (the default).")
    shuffle, seed = _order_of(dataloader.sampler)
    schedule = ExactlyOnceSchedule(
        num_samples=len(dataset),
        batch_size=dataloader.batch_size,
        group_size=group_size,
        group_rank=group_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=dataloader.drop_last,
    )
    data = ExactlyOnceData(schedule, dataset, dataloader.collate_fn, participants_guess, rank_guess, committed)
    workers = dataloader.num_workers
    loader = DataLoader(
        dataset,
        batch_sampler=PredictingBatchSampler(data),
        num_workers=workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor if workers > 0 else None,
        persistent_workers=dataloader.persistent_workers if workers > 0 else False,
        pin_memory_device=dataloader.pin_memory_device,
    )
    return loader, data


def _order_of(sampler: Sampler | Iterable[Any]) -> tuple[bool, int]:
    """Whether the user asked for shuffling, and with which seed, from the sampler the loader was given."""
    if isinstance(sampler, DistributedSamplerWrapper):  # Lightning's wrapper around a custom sampler
        sampler = lightning_internals.custom_sampler(sampler)
    elif isinstance(sampler, DistributedSampler):  # Lightning's, built from the user's shuffle=...
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, RandomSampler):
        return True, 0
    if isinstance(sampler, SequentialSampler):
        return False, 0
    raise FTConfigError(
        f"data_mode='exactly_once' draws its own permutation per epoch and cannot follow the custom sampler "
        f"{type(sampler).__name__}. Use DataLoader(shuffle=True/False), or data_mode='sharded'."
    )


def check_data_mode(data_mode: str, algorithm: str, use_async_quorum: bool) -> None:
    """Check ``data_mode`` against the other settings. Exactly-once data must know a step's quorum before its batch
    is final: ``use_async_quorum`` defaults to ``False`` with it (:mod:`lightning_ft.configuration`), and an explicit
    ``True`` is refused here."""
    if data_mode not in DATA_MODES:
        raise FTConfigError(f"data_mode={data_mode!r}: must be one of {', '.join(map(repr, DATA_MODES))}.")
    if data_mode == "sharded":
        return
    if algorithm != "ddp":
        raise FTConfigError(
            f"data_mode='exactly_once' with algorithm={algorithm!r}: exactly-once data follows per-step commits, "
            "and the semi-synchronous algorithms commit only at their syncs. Use algorithm='ddp', or "
            "data_mode='sharded'."
        )
    if use_async_quorum:
        raise FTConfigError(
            "data_mode='exactly_once' with use_async_quorum=True: a step's samples depend on its quorum, so the quorum "
            "must form before the forward pass. Remove use_async_quorum (it defaults to False in this mode)."
        )

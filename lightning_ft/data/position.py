"""Where a replica group is in its own shard of the data, and how to move its data iterator there.

Each group reads its own shard (see ``FTStrategy.distributed_sampler_kwargs``), but all groups must stay at the same
*loop position*: the same epoch and the same batch index within it. Lightning decides when to validate, when an
epoch ends and when to step epoch-interval schedulers from its batch counters, and the callbacks and metrics that
run at those moments may use collectives across groups, so every group has to reach them at the same step.

Two events move a group away from where its data iterator is:

* **A heal.** A restarted group starts its epoch loop from scratch (epoch 0, batch 0), then receives a live peer's
  state. Its batch counters are shifted to the peer's (:func:`shift_batch_progress`), and its iterator is moved
  so that the next batch it reads is the batch at the peer's next index *in this group's own shard*
  (:func:`reposition_fetcher`).
* **A resume from a checkpoint.** Lightning restores the loop counters, but a plain ``DataLoader`` starts its epoch
  over, and Lightning's own resume of a ``StatefulDataLoader`` creates the iterator before it sets the sampler's
  epoch. The iterator is recreated and moved (:func:`resume_fetcher`).

Moving forward means reading and discarding batches through Lightning's fetcher (``next(fetcher)``), which keeps
the fetcher's ``fetched`` counter, and so Lightning's "last batch" detection, consistent. Samplers that shuffle
must be deterministic per epoch (``DistributedSampler``, which Lightning installs, is).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_ft import lightning_internals


@dataclass(frozen=True)
class LoopPosition:
    """The fit loop's position: the epoch, and how many batches were made ready in it (``current_ready``) and in
    the whole fit (``total_ready``), as Lightning's ``batch_progress`` counts them.

    ``current_ready`` is also the index of the next batch the epoch will read.
    """

    epoch: int
    current_ready: int
    total_ready: int

    @classmethod
    def of(cls, trainer: pl.Trainer) -> LoopPosition:
        fit_loop = trainer.fit_loop
        progress = fit_loop.epoch_loop.batch_progress
        # `processed` is the epoch Lightning sets on the samplers at epoch start (see FitLoop.on_advance_start).
        epoch = fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]  # a _ProcessedTracker
        return cls(epoch, progress.current.ready, progress.total.ready)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoopPosition:
        return cls(int(state["epoch"]), int(state["current_ready"]), int(state["total_ready"]))


def shift_batch_progress(progress: lightning_internals.BatchProgress, current_delta: int, total_delta: int) -> None:
    """Move every batch counter by the same amount, ``current`` by ``current_delta`` and ``total`` by
    ``total_delta``.

    Every counter moves, not just ``ready``: ``started``, ``processed`` and ``completed`` keep their offsets to
    ``ready``, which say how far the batch in flight has got. That phase is this replica's own and must survive the
    shift, because a heal happens at a different point of the batch on the healing replica (the quorum or the commit
    vote) than the point where its peer's position was taken.
    """
    for tracker, delta in ((progress.current, current_delta), (progress.total, total_delta)):
        tracker.ready += delta
        tracker.started += delta  # type: ignore[attr-defined]
        tracker.processed += delta  # type: ignore[attr-defined]
        tracker.completed += delta


def align_with_peer(progress: lightning_internals.BatchProgress, own: LoopPosition, peer: LoopPosition) -> None:
    """Shift this replica's counters so that ``own`` (a position this replica was at) becomes ``peer``."""
    shift_batch_progress(progress, peer.current_ready - own.current_ready, peer.total_ready - own.total_ready)


def supports_repositioning(fetcher: lightning_internals.DataFetcher) -> bool:
    """Whether Lightning reads the batches itself. With ``training_step(dataloader_iter)`` the user does, so the
    position cannot be moved from outside."""
    return not isinstance(fetcher, lightning_internals.DataLoaderIterDataFetcher)


def iterator_position(fetcher: lightning_internals.DataFetcher) -> int:
    """Index of the batch the next ``next(fetcher)`` returns (a prefetching fetcher has read ahead)."""
    return fetcher.fetched - len(getattr(fetcher, "batches", ()))


def skip_batches(fetcher: lightning_internals.DataFetcher, count: int) -> int:
    """Read and discard up to ``count`` batches; returns how many were skipped (fewer if the epoch ran out)."""
    for skipped in range(count):
        try:
            next(fetcher)
        except StopIteration:
            return skipped
    return count


def reposition_fetcher(
    fetcher: lightning_internals.DataFetcher,
    loaders: Iterable[object],
    *,
    iterator_epoch: int,
    target_epoch: int,
    target_position: int,
) -> str:
    """Make the next batch ``fetcher`` returns the one at index ``target_position`` of ``target_epoch``.

    ``iterator_epoch`` is the epoch the fetcher's current iterator reads. Same epoch and ahead: read forward.
    Otherwise (another epoch, or behind): set every sampler to ``target_epoch``, start a new iterator and read
    forward from the beginning. Returns ``"forward"`` or ``"restart"``, for the event log.
    """
    if target_epoch == iterator_epoch and target_position >= iterator_position(fetcher):
        skip_batches(fetcher, target_position - iterator_position(fetcher))
        return "forward"
    for loader in loaders:
        lightning_internals.set_sampler_epoch(loader, target_epoch)
    iter(fetcher)
    skip_batches(fetcher, target_position - iterator_position(fetcher))
    return "restart"


@dataclass
class ResumePlan:
    """How a resumed fit reaches its restored position: ``loader_states`` (this rank's own ``StatefulDataLoader``
    states, restored by Lightning) or, when there are none, by counting ``batch_progress.current.ready`` batches."""

    loader_states: list[dict[str, Any]] | None

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any]) -> ResumePlan | None:
        """None when the checkpoint holds no fit-loop state (nothing to resume)."""
        fit_loop = checkpoint.get("loops", {}).get("fit_loop")
        if fit_loop is None:
            return None
        states = fit_loop.get("state_dict", {}).get("combined_loader")
        # A copy: Lightning hands the same objects to the loaders first, and they are loaded a second time here.
        return cls(copy.deepcopy(states) if states else None)

    @property
    def source(self) -> str:
        return "loader_state" if self.loader_states else "counting"


def resume_fetcher(trainer: pl.Trainer, fetcher: lightning_internals.DataFetcher, plan: ResumePlan) -> int:
    """Put a resumed fit's iterator at the restored batch; returns that batch's index.

    Runs right after the epoch loop's ``on_run_start``, where Lightning has set the samplers' epoch and added the
    restored ``current.ready`` to ``fetcher.fetched``, but its iterator was created before the epoch was set (so a
    ``StatefulDataLoader`` restored into a later epoch replays the first epoch's order) and, for a plain
    ``DataLoader``, starts at the beginning of the epoch. The iterator is therefore created again: from the
    loader states when there are some, else from the start of the epoch and moved forward by counting.
    """
    position = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    combined_loader = lightning_internals.combined_loader(trainer)
    assert combined_loader is not None
    if plan.loader_states:
        lightning_internals.load_loader_states(combined_loader, plan.loader_states)
        iter(fetcher)
        fetcher.fetched += position
        if fetcher.length is not None:
            fetcher.done = fetcher.fetched >= fetcher.length
    elif position or _order_depends_on_epoch(combined_loader.flattened):
        iter(fetcher)
        skip_batches(fetcher, position)
    # Otherwise Lightning's iterator already starts the epoch in its order: a new one would drop the batch it has
    # fetched ahead, which a stream (a queue, a socket) cannot give again.
    return position


def _order_depends_on_epoch(loaders: list[Any]) -> bool:
    """Whether any loader's order follows ``set_epoch`` (its sampler's, its batch sampler's or its dataset's), as
    Lightning's ``_set_sampler_epoch`` looks for it."""
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        parts = (
            getattr(loader, "sampler", None),
            getattr(batch_sampler, "sampler", None),
            getattr(loader, "dataset", None),
        )
        if any(callable(getattr(part, "set_epoch", None)) for part in parts):
            return True
    return False

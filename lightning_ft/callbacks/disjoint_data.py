"""At the job's first step the replica groups compare their first batches: two groups that read the same samples are
named in a warning, with the fix.

The silent way to lose a job's worth of work: data code that shards by the group's world instead of the job's. A
``DistributedSampler`` built from torch.distributed is re-sharded by the strategy
(:func:`~lightning_ft.data.job_shard.fit_sampler_to_job`), but an ``IterableDataset`` that splits its stream by
``torch.distributed.get_rank()``, a custom batch sampler or a sampler subclass shard however their code says, and
under FTStrategy that code sees one group. Every group then trains on the same batches; nothing fails.

Whatever the data code, its effect shows in the batches. At the job's first optimizer step (committed step 0), every
process digests its first batch exactly (the sum and sum of squares of its tensors' bytes, as the consistency check
digests parameters) and the digests are gathered across groups on the step's own quorum, before the forward pass.
Equal digests at the same group rank in two groups mean the same samples: a warning and a ``duplicate_data`` event
name the groups and the fix. Every group of a step-0 quorum makes the gather (a group healing at step 0 heals before
the forward pass, so it is at step 0 too); a group that joins a running job (committed step > 0) makes none. Data
that repeats by design (a constant batch) warns too; nothing else changes.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_ft.callbacks._access import (
    ft_collectives,
    ft_exactly_once_data,
    ft_manager,
    ft_settings,
    ft_step_protocol,
    is_semi_sync,
)
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.callbacks.consistency import parameter_fingerprint
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")


def batch_digest(batch: Any) -> tuple[int, int] | None:
    """An exact digest of every tensor of a batch (``None`` when it holds none)."""
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    return parameter_fingerprint(tensors) if tensors else None


def duplicated_groups(rows: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """``(rank, group, other group)`` for every two groups whose first batches at the same group rank are equal;
    rows are ``(group, rank, has_digest, total, squares)``."""
    seen: dict[tuple[int, int, int], int] = {}
    pairs = []
    for group, rank, has_digest, total, squares in sorted(rows):
        if not has_digest:
            continue
        first = seen.setdefault((rank, total, squares), group)
        if first != group:
            pairs.append((rank, first, group))
    return pairs


class DisjointDataCheck(FTCallback):
    """Warns once when two replica groups read the same first batch at the job's first step (see the module)."""

    def __init__(self) -> None:
        self._settled = False
        self.warned = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._settled = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._settled or not ft_step_protocol(trainer).quorum_open:  # a quorum callback placed after this one
            return
        settings = ft_settings(trainer)
        if (
            settings is None
            or settings.num_replica_groups < 2
            or is_semi_sync(trainer)  # its quorums are at the syncs, not at every batch
            or ft_exactly_once_data(trainer) is not None  # its batches are placed disjoint by construction
        ):
            self._settled = True
            return
        manager = ft_manager(trainer)
        manager.wait_quorum()  # the step's quorum tells whether the job is at step 0 (a late joiner heals past it)
        if manager.current_step() != 0:
            self._settled = True
            return
        digest = batch_digest(batch)
        mine = torch.tensor(
            [settings.replica_group_id, trainer.global_rank, digest is not None, *(digest or (0, 0))],
            dtype=torch.int64,
        )
        rows = [tuple(int(v) for v in row.tolist()) for row in ft_collectives(trainer).all_gather(mine)]
        pairs = duplicated_groups(rows)
        if not pairs or self.warned:
            return
        self.warned = True
        groups = sorted({group for _, first, other in pairs for group in (first, other)})
        events.emit("duplicate_data", groups=groups, pairs=[list(pair) for pair in pairs])
        log.warning(
            "lightning-ft: replica groups %s read the same first batch (at group rank %s): their sampler or dataset "
            "shards by the group's rank and world size, not the job's, so every group trains on the same samples. "
            "Let Lightning add the sampler (no sampler of your own, use_distributed_sampler=True), build yours with "
            "trainer.strategy.distributed_sampler_kwargs, and shard an IterableDataset by lightning_ft.job_shard() "
            "(docs/your-code.md). If your data repeats by design, ignore this.",
            groups,
            sorted({rank for rank, _, _ in pairs}),
        )

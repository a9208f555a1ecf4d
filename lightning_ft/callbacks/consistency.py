"""Replica consistency check: every N committed steps, replicas compare a fingerprint of their parameters and
buffers.

Replicas are meant to be bit-identical after every committed step. A bug, a bad heal, or silent data corruption on
one machine breaks that without any error: the diverged replica keeps training and contributes gradients computed
from other weights. This callback detects it, names the diverged group, and makes it heal from the majority (or
stops the job).

The fingerprint is exact and cheap: each parameter's bytes are read as 32-bit integers and summed (and their squares
summed) in 64-bit integer arithmetic, which wraps instead of rounding, so the result does not depend on the order of
the summation, the device or the kernel. Two replicas with identical bytes always agree; a single flipped bit changes
it. It costs one pass over the parameters and one small all-gather every N steps.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_ft import lightning_internals as lightning
from lightning_ft.callbacks._access import ft_collectives, ft_manager, ft_settings, ft_step_protocol, is_semi_sync
from lightning_ft.errors import LightningFTError
from lightning_ft.settings import FTConfigError, FTSettings
from lightning_ft.step.buffers import synced_buffers
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")
OnDivergence = Literal["heal", "stop"]


class ReplicaDivergedError(LightningFTError, RuntimeError):
    """Replicas that should be bit-identical are not."""


def parameter_fingerprint(parameters: list[Tensor]) -> tuple[int, int]:
    """An exact, order-independent fingerprint of the parameters' bytes (this process's shards for DTensors)."""
    total = torch.zeros((), dtype=torch.int64)
    squares = torch.zeros((), dtype=torch.int64)
    for parameter in parameters:
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        data = local.detach().contiguous().reshape(-1)
        words = data.view(torch.int32) if data.numel() * data.element_size() % 4 == 0 else data.view(torch.uint8)
        words = words.to(torch.int64)
        total += words.sum().cpu()
        squares += (words * words).sum().cpu()
    return int(total), int(squares)


class ReplicaConsistencyCheck(Callback):
    """Every ``every_n_steps`` committed steps, compare every replica's fingerprint of its parameters and buffers
    (those that ``buffer_sync="average"`` keeps identical) across groups.

    The check runs at the end of the batch whose vote committed the step, in a sync section among the groups that
    committed it (on that step's quorum, or on a section quorum of its own if a collective failed). Not at the start
    of a step: with asynchronous quorum a group that heals in that step only learns the committed step count once the
    quorum is in, so it could not know whether the others are about to check, and a collective that only some groups
    make can abort a healthy peer inside Gloo. After the vote every group of the step's quorum, a healed one
    included, has the same count. Rank r of each group is compared with rank r of the others (with sharded parameters
    they hold the same shard). A group whose fingerprint differs from the majority's is named in an error log and a
    ``replica_diverged`` event, then:

    * ``on_divergence="heal"`` (default): the diverged group stops with :class:`ReplicaDivergedError`; torchrun
      restarts it and it heals from a live peer, like any failed group. The others go on (they lose at most the
      step after the check).
    * ``on_divergence="stop"``: every group stops with :class:`ReplicaDivergedError`.

    Without a strict majority (two groups that disagree) nobody can tell which one is right: every group stops.

    Args:
        every_n_steps: Check when the committed step count is a multiple of this.
        on_divergence: ``"heal"`` or ``"stop"``.
    """

    def __init__(self, every_n_steps: int = 100, on_divergence: OnDivergence = "heal") -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise FTConfigError(f"ReplicaConsistencyCheck(every_n_steps={every_n_steps!r}): must be an integer >= 1.")
        if on_divergence not in ("heal", "stop"):
            raise FTConfigError(
                f"ReplicaConsistencyCheck(on_divergence={on_divergence!r}): choose 'heal' (the diverged group "
                f"restarts and heals from the majority) or 'stop' (the job stops)."
            )
        self.every_n_steps = every_n_steps
        self.on_divergence = on_divergence
        self.checks = 0
        self._checked_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and is_semi_sync(trainer):
            raise FTConfigError(
                "ReplicaConsistencyCheck works with algorithm='ddp' only: with local_sgd/diloco replicas differ by "
                "design between two syncs. Remove the callback or use algorithm='ddp'."
            )
        self._checked_step = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if lightning.should_accumulate(trainer):  # no vote in this batch
            return
        if not ft_step_protocol(trainer).last_step_committed:
            return  # the vote failed in every group of the quorum: the count they share did not move
        manager = ft_manager(trainer)
        step = manager.current_step()
        if step == 0 or step % self.every_n_steps or step == self._checked_step:
            return
        self._checked_step = step
        settings = ft_settings(trainer)
        group = settings.replica_group_id if settings is not None else 0
        total, squares = parameter_fingerprint(fingerprinted_tensors(pl_module, settings))
        mine = torch.tensor([group, trainer.global_rank, total, squares], dtype=torch.int64)
        collectives = ft_collectives(trainer)
        collectives.open_section()
        try:
            everyone = collectives.all_gather(mine)
        finally:
            collectives.close_section()  # the batch's own logging after this stays where it was
        self.checks += 1
        diverged, undecided = _diverged_groups([tuple(int(v) for v in row.tolist()) for row in everyone])
        if not diverged and not undecided:
            return
        groups = sorted(diverged | undecided)
        events.emit("replica_diverged", step=step, groups=groups, majority=not undecided)
        message = (
            f"lightning-ft: replica consistency check at committed step {step}: the parameters or buffers of "
            f"replica group(s) "
            f"{groups} differ from "
            + ("the majority's" if not undecided else "each other's, and no majority can tell which is right")
            + " (a bug, a bad heal, or silent data corruption)."
        )
        log.error(message)
        if undecided or self.on_divergence == "stop":
            raise ReplicaDivergedError(message + " Stopping (ReplicaConsistencyCheck(on_divergence='stop')).")
        if group in diverged:
            raise ReplicaDivergedError(
                message + " This group stops now so that it restarts and heals from a live peer "
                "(ReplicaConsistencyCheck(on_divergence='heal'))."
            )


def fingerprinted_tensors(module: pl.LightningModule, settings: FTSettings | None) -> list[Tensor]:
    """The parameters, and the buffers that the job averages (``buffer_sync="average"``, the default): both are
    meant to be bit-identical at every committed step. With ``buffer_sync="off"`` buffers differ by design."""
    tensors: list[torch.Tensor] = list(module.parameters())
    if settings is None or settings.buffer_sync == "average":
        tensors += [getattr(owner, attribute) for _, owner, attribute in synced_buffers(module)]
    return tensors


def _diverged_groups(rows: list[tuple[int, ...]]) -> tuple[set[int], set[int]]:
    """From ``(group, rank, fingerprint...)`` rows: the groups that differ from a strict majority at some rank, and
    the groups at ranks where there is no strict majority."""
    by_rank: dict[int, dict[int, tuple[int, ...]]] = {}
    for group, rank, *fingerprint in rows:
        by_rank.setdefault(rank, {})[group] = tuple(fingerprint)
    diverged: set[int] = set()
    undecided: set[int] = set()
    for fingerprints in by_rank.values():
        value, count = Counter(fingerprints.values()).most_common(1)[0]
        if count == len(fingerprints):
            continue
        if count * 2 > len(fingerprints):
            diverged |= {group for group, fp in fingerprints.items() if fp != value}
        else:
            undecided |= set(fingerprints)
    return diverged, undecided

"""Replica consistency check: the groups prove that they hold the same training state, every N committed steps and
at the end of ``fit``.

Replicas are meant to be bit-identical after every committed step. A bug, a bad heal, or silent data corruption on
one machine breaks that without any error: the diverged replica keeps training and contributes gradients computed
from other weights. This check compares a fingerprint of the whole state a heal carries (Lightning's checkpoint:
model, optimizers, schedulers, precision plugin, callbacks, what hooks add; :mod:`lightning_ft.heal.fingerprint`)
entry by entry, names the diverged group and the entries that differ, and makes that group heal from the majority (or
stops the job).

The fingerprint is exact and cheap: every tensor's bytes are read as 32-bit integers and summed (and their squares
summed) in 64-bit integer arithmetic, which wraps instead of rounding, so the result does not depend on the order of
the summation, the device or the kernel. Two replicas with identical bytes always agree; a single flipped bit changes
it. It costs one pass over the state and one small all-gather per check (``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_ft import lightning_internals
from lightning_ft.callbacks._access import ft_collectives, ft_manager, ft_settings, ft_step_protocol, is_semi_sync
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.errors import LightningFTError
from lightning_ft.heal.fingerprint import state_fingerprints
from lightning_ft.settings import FTConfigError
from lightning_ft.step.buffers import synced_buffers
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")
OnDivergence = Literal["heal", "stop"]

# Every this many committed steps, besides the last: a check measured at most 2.7 steps' time (a small-batch MLP on a
# CPU, the least compute per byte of state; docs/benchmarks.md, "Replica consistency check"), so checking every 500
# steps keeps it under 1% of the training time (0.54%).
DEFAULT_EVERY_N_STEPS = 500


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


class ReplicaConsistencyCheck(FTCallback):
    """Every ``every_n_steps`` committed steps and at the job's last step, compare every replica's fingerprint of the
    whole training state across groups (:mod:`lightning_ft.heal.fingerprint`). FTStrategy adds one with the defaults
    to every per-step (``algorithm="ddp"``) fit; give your own to change them.

    The check runs at the end of the batch whose vote committed the step, in a sync section among the groups that
    committed it (on that step's quorum, or on a section quorum of its own if a collective failed), before any
    checkpoint callback of that batch: at the last step, before any group writes its final checkpoint. Not at the
    start of a step: with asynchronous quorum a group that heals in that step only learns the committed step count
    once the quorum is in, so it could not know whether the others are about to check, and a collective that only
    some groups make can abort a healthy peer inside Gloo. After the vote every group of the step's quorum, a healed
    one included, has the same count. Rank r of each group is compared with rank r of the others (with sharded
    state they hold the same shard). A group whose fingerprint differs from the majority's is named, with the
    entries that differ, in a warning and a ``replica_diverged`` event, then:

    * ``on_divergence="heal"`` (default): the diverged group stops with :class:`ReplicaDivergedError`; torchrun
      restarts it and it heals from a live peer, like any failed group. The others go on (they lose at most the
      step after the check). At the last step there is no step after: the others finish, and the restart finds the
      job finished.
    * ``on_divergence="stop"``: every group stops with :class:`ReplicaDivergedError`.

    Without a strict majority (two groups that disagree) nobody can tell which one is right: every group stops.

    Building the state runs the ``on_save_checkpoint`` hooks, as a heal does: they must only read.

    Args:
        every_n_steps: Check when the committed step count is a multiple of this (and at the last step).
        on_divergence: ``"heal"`` or ``"stop"``.

    Attributes:
        checks: How many checks this callback has run in this process.

    Raises:
        FTConfigError: ``every_n_steps`` is not an integer >= 1, or ``on_divergence`` is neither ``"heal"`` nor
            ``"stop"``.
    """

    def __init__(self, every_n_steps: int = DEFAULT_EVERY_N_STEPS, on_divergence: OnDivergence = "heal") -> None:
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
        """Refuse a semi-synchronous fit, whose replicas differ by design between two syncs.

        Raises:
            FTConfigError: The fit's ``algorithm`` is ``"local_sgd"`` or ``"diloco"``.
        """
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
        """Run the check when the step this batch committed is due (every ``every_n_steps``, and the last).

        Raises:
            ReplicaDivergedError: This group's state differs from the majority's (``on_divergence="heal"``), or
                any group's does (``"stop"``), or no strict majority exists.
            StrategyRequiredError: The strategy has no torchft Manager, step protocol or collectives.
        """
        if lightning_internals.should_accumulate(trainer):  # no vote in this batch
            return
        if not ft_step_protocol(trainer).last_step_committed:
            return  # the vote failed in every group of the quorum: the count they share did not move
        manager = ft_manager(trainer)
        step = manager.current_step()
        due = step % self.every_n_steps == 0 or _ends_the_fit(trainer)
        if step == 0 or not due or step == self._checked_step:
            return
        self._checked_step = step
        settings = ft_settings(trainer)
        group = settings.replica_group_id if settings is not None else 0
        averaged = settings is None or settings.buffer_sync == "average"  # "off": buffers differ by design
        synced = {name for name, _, _ in synced_buffers(pl_module)} if averaged else set()
        mine = {"group": group, "rank": trainer.global_rank, "entries": state_fingerprints(trainer, synced)}
        # On the model's device: the cross-group process group is NCCL on a GPU.
        payload = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(pl_module.device)
        collectives = ft_collectives(trainer)
        collectives.open_section(reduces_data=False)
        try:
            everyone = collectives.all_gather(payload)
        finally:
            collectives.close_section()  # the batch's own logging after this stays where it was
        self.checks += 1
        rows = [json.loads(row.to(torch.uint8).cpu().numpy().tobytes()) for row in everyone]
        diverged, undecided, entries = _diverged_groups(rows)
        if not diverged and not undecided:
            return
        groups = sorted(diverged | undecided)
        events.emit("replica_diverged", step=step, groups=groups, majority=not undecided, entries=entries)
        message = (
            f"lightning-ft: replica consistency check at committed step {step}: the training state of replica "
            f"group(s) {groups} differs from "
            + ("the majority's" if not undecided else "each other's, and no majority can tell which is right")
            + f" in {', '.join(entries)} (a bug, a bad heal, or silent data corruption)."
        )
        log.warning(message)
        if undecided or self.on_divergence == "stop":
            raise ReplicaDivergedError(message + " Stopping (ReplicaConsistencyCheck(on_divergence='stop')).")
        if group in diverged:
            raise ReplicaDivergedError(
                message + " This group stops now so that it restarts and heals from a live peer "
                "(ReplicaConsistencyCheck(on_divergence='heal'))."
            )


def _ends_the_fit(trainer: pl.Trainer) -> bool:
    """Whether the step just committed is the fit's last: ``max_steps`` reached, or the last batch of the last epoch
    (a stop that a callback decides, such as early stopping, is not known here)."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return bool(last_epoch and trainer.is_last_batch)


def _diverged_groups(rows: list[dict[str, Any]]) -> tuple[set[int], set[int], list[str]]:
    """From every process's ``{"group", "rank", "entries"}``: the groups that differ from a strict majority at some
    rank, the groups at ranks where there is no strict majority, and the entries in which they differ."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), {})[int(row["group"])] = row["entries"]
    diverged: set[int] = set()
    undecided: set[int] = set()
    differing: set[str] = set()
    for fingerprints in by_rank.values():
        keys = {group: json.dumps(entries, sort_keys=True) for group, entries in fingerprints.items()}
        value, count = Counter(keys.values()).most_common(1)[0]
        if count == len(keys):
            continue
        reference = json.loads(value)
        odd = {group for group, key in keys.items() if key != value}
        if count * 2 > len(keys):
            diverged |= odd
        else:
            undecided |= set(keys)
        for group in odd:
            entries = fingerprints[group]
            differing |= {name for name in set(entries) | set(reference) if entries.get(name) != reference.get(name)}
    return diverged, undecided, sorted(differing)

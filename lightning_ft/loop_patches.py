"""The few places where lightning-ft changes what a Lightning object does, each undone when the fit ends.

Lightning has no hook at these points, so a bound method (or an attribute) is shadowed by an instance attribute on
the one object, for one fit: the classes stay Lightning's own, and a trainer that fits again starts clean. The
strategy and the callbacks use the same mechanism, :class:`LoopPatches`:

* :func:`settle_each_step`: each batch's step ends before any ``on_train_batch_end`` hook, and step-interval LR
  schedulers advance only on a committed step;
* :func:`keep_dataloader_checks_group_local`: Lightning's once-per-process "is the dataloader empty" reduction
  stays inside the group (a restarted group asks when its peers do not);
* :func:`sync_metrics_across_groups`: torchmetrics objects sync over every participating replica;
* :func:`name_checkpoints_alike`: ``ModelCheckpoint`` names a checkpoint the same in every group;
* :func:`summarize_the_model_once`: the model summary is printed once per job, not once per group;
* the resume of :mod:`lightning_ft.start.lifecycle`, the exactly-once training loader
  (:mod:`lightning_ft.data.exactly_once_training`), the data position's epoch start and the progress bar's
  ``replicas P/N`` (:mod:`lightning_ft.callbacks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_ft import lightning_internals
from lightning_ft.start.record import JobRecord
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.owner import StepOwner

log = logging.getLogger("lightning.pytorch.lightning_ft")

_ABSENT = object()


class LoopPatches:
    """Instance-attribute replacements on Lightning objects, undone in reverse order by :meth:`undo`."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, target: object, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Shadow ``target.name`` with ``make(original)``; ``original`` is what ``target.name`` is now (possibly an
        earlier patch, which the new one then wraps)."""
        self.assign(target, name, make(getattr(target, name)))

    def assign(self, target: object, name: str, value: object) -> None:
        """Set ``target.name`` to ``value`` until :meth:`undo`, which restores the instance's own earlier value (or
        removes the attribute, so the class's shows again)."""
        self._undo.append((target, name, vars(target).get(name, _ABSENT)))
        setattr(target, name, value)

    def undo(self) -> None:
        for target, name, previous in reversed(self._undo):
            if previous is _ABSENT:
                vars(target).pop(name, None)
            else:
                setattr(target, name, previous)
        self._undo.clear()


def settle_each_step(patches: LoopPatches, trainer: pl.Trainer, owner: StepOwner) -> None:
    """End each batch's step (:meth:`StepOwner.end`) and let step-interval LR schedulers advance only on a commit.

    Both sit on the epoch loop's post-batch scheduler update (``update_lr_schedulers("step", False)``): the one point
    after a batch's forward, backward and optimizer step and before any ``on_train_batch_end`` hook, whatever the
    order of the trainer's callbacks. Lightning steps schedulers after every optimizer step, committed or not; the
    gate keeps the scheduler objects the user's own (``self.lr_schedulers()`` and checkpoints see the real thing).
    The update after validation (plateau schedulers, ``update_plateau_schedulers=True``) is gated only.
    """

    def make(update: Callable[[str, bool], None]) -> Callable[[str, bool], None]:
        def settle_then_update(interval: str, update_plateau_schedulers: bool) -> None:
            if interval == "step" and not update_plateau_schedulers:
                owner.end(trainer)
            if interval == "step" and not owner.advances_schedulers():
                return
            update(interval, update_plateau_schedulers)

        return settle_then_update

    patches.wrap(trainer.fit_loop.epoch_loop, "update_lr_schedulers", make)


def keep_dataloader_checks_group_local(
    patches: LoopPatches, trainer: pl.Trainer, collectives: CrossGroupCollectives
) -> None:
    """Lightning asks every rank whether its dataloader is empty once per process lifetime, through
    ``Strategy.reduce``. A restarted group asks when its peers do not, so that question stays inside the group."""

    def make(setup_data: Callable[[], None]) -> Callable[[], None]:
        def group_local_setup_data() -> None:
            with collectives.group_local():
                setup_data()

        return group_local_setup_data

    for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
        patches.wrap(loop, "setup_data", make)


def sync_metrics_across_groups(patches: LoopPatches, module: pl.LightningModule, all_gather: Callable) -> None:
    """torchmetrics ``Metric`` objects of the module sync over every participating replica, not just the group.

    A metric's own ``dist_sync_fn`` or ``process_group``, when the user set one, is left alone.
    """
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric) and metric.dist_sync_fn is None and metric.process_group is None:
            patches.assign(metric, "dist_sync_fn", all_gather)


def summarize_the_model_once(patches: LoopPatches, trainer: pl.Trainer) -> None:
    """Silence ``ModelSummary`` (and ``RichModelSummary``) outside the job's rank 0.

    They print from ``trainer.is_global_zero``, which is true in every group's rank 0 (ranks stay group-local); every
    group would print the same table. Lightning's other rank-zero output already follows the job-wide rank.
    """
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning at run time
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, ModelSummary):
            patches.assign(callback, "on_fit_start", lambda *args, **kwargs: None)


class _WithoutProcessGroupBanner(logging.Filter):
    """Drops Lightning's "All distributed processes registered. Starting with N processes" banner (five lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "All distributed processes registered" not in record.getMessage()


@contextmanager
def without_process_group_banner() -> Iterator[None]:
    """Around ``DDPStrategy.setup_distributed``: Lightning's banner counts the processes of one group's process group
    ("Starting with 1 processes" in a job of many groups), which misleads more than it tells; the group's
    ``Initializing distributed`` line stays."""
    from lightning_utilities.core import rank_zero  # its ``log``: the logger Lightning's rank_zero_info writes to

    logger = rank_zero.log
    quiet = _WithoutProcessGroupBanner()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def name_checkpoints_alike(patches: LoopPatches, trainer: pl.Trainer) -> None:
    """Turn off ``ModelCheckpoint``'s version counter, which would name one checkpoint differently per group.

    Every group runs ``ModelCheckpoint``; only the writer writes. With the counter on, a group that checks for
    ``step=N.ckpt`` after the writer wrote it calls its own copy ``step=N-v1.ckpt``, so its callback state (best,
    last and top-k paths) names files that are never written, and a group that takes over writing would save under
    other names. Without it, a name is a function of the step and metrics only, the same everywhere; an existing
    file of that name is overwritten, as when a job resumes into its own directory.
    """
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and lightning_internals.version_counter_on(callback):
            patches.assign(callback, lightning_internals.VERSION_COUNTER, False)
            log.info(
                "lightning-ft: ModelCheckpoint(enable_version_counter=True) is turned off: every replica group "
                "must give a checkpoint the same name."
            )


def version_against_other_runs(patches: LoopPatches, trainer: pl.Trainer, wrote: Callable[[str], bool]) -> None:
    """Keep ``ModelCheckpoint``'s version counter for files of other runs only (one replica group of a run a launcher
    can restart): a restart of the run writes its checkpoints under the names it wrote them before (``wrote``, from
    the run's record), as a resume into its own directory does, while a file of an earlier run in the folder is kept
    and the new one named ``-v1``, as Lightning names it."""

    def make(original: Callable[..., bool]) -> Callable[..., bool]:
        def exists_from_another_run(filepath: str, trainer: pl.Trainer) -> bool:
            return original(filepath, trainer) and not wrote(filepath)

        return exists_from_another_run

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and lightning_internals.version_counter_on(callback):
            patches.wrap(callback, "file_exists", make)


def prepare_the_fit(
    patches: LoopPatches, trainer: pl.Trainer, owner: StepOwner | None, record: JobRecord | None, groups: int
) -> None:
    """Every patch a fit takes: per step (an ``owner``), the loop settles each step on the committed count; with
    several groups, checkpoints are named alike in every group; a job of one group versions its logs against other
    runs in the folder (``record``); the model is summarised once."""
    if owner is not None:
        settle_each_step(patches, trainer, owner)
    if groups > 1:
        name_checkpoints_alike(patches, trainer)
    elif record is not None and record.exists:
        version_against_other_runs(patches, trainer, record.wrote)
    summarize_the_model_once(patches, trainer)


def cross_groups_where_every_group_is(
    patches: LoopPatches, trainer: pl.Trainer, collectives: CrossGroupCollectives
) -> None:
    """Reductions may cross groups from setup on: the dataloader checks stay inside the group, ``self.log(...,
    sync_dist=True)`` and torchmetrics reduce over the job."""
    keep_dataloader_checks_group_local(patches, trainer, collectives)
    module = trainer.lightning_module
    sync_metrics_across_groups(patches, module, collectives.all_gather)

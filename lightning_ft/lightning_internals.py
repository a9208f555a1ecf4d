"""Every private Lightning name lightning-ft uses, in one module: what it is, why it is used, and what public API would
replace it, one row per name in :data:`PRIVATE_USES`, the one inventory. Lightning is pinned ``<2.7``; a Lightning
upgrade is a diff here and in ``strategy.py``, whose overrides of private hooks can only sit in the subclass
(``tests/package/test_seams.py`` keeps private Lightning names out of every other module, and every one in its row).

The loop patches that replace Lightning methods are in :mod:`lightning_ft.loop_patches`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import _atomic_save as atomic_save
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol as is_local_file_protocol
from lightning.fabric.utilities.cloud_io import _load as load_file
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.types import _PATH as PathLike
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from lightning.pytorch.loops.fetchers import _DataFetcher as DataFetcher
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher as DataLoaderIterDataFetcher
from lightning.pytorch.loops.progress import _BatchProgress as BatchProgress
from lightning.pytorch.overrides.distributed import _sync_module_states as sync_module_states

__all__ = [
    "VERSION_COUNTER",
    "BatchProgress",
    "DataFetcher",
    "DataLoaderIterDataFetcher",
    "PathLike",
    "atomic_save",
    "batches_that_stepped",
    "checkpoint_connector",
    "combined_loader",
    "data_fetcher",
    "dump_checkpoint",
    "is_local_file_protocol",
    "layer_sync",
    "load_file",
    "optimizers_to_device",
    "pruning_kept_as_trained",
    "restore_from_checkpoint",
    "run_on_before_batch_transfer",
    "set_batches_that_stepped",
    "set_device_mesh",
    "set_sampler_epoch",
    "should_accumulate",
    "should_update_logs",
    "sync_module_states",
    "version_counter_on",
]


# Every private Lightning name lightning-ft reaches, here and in strategy.py (a DDPStrategy subclass), one row each:
# why; the public API that would replace it (the docstring's table says more). Checked by
# ``tests/package/test_seams.py``.
PRIVATE_USES = {
    "_PATH": "the type of a checkpoint path argument; a public path type alias",
    "_atomic_save": "write checkpoints and sidecars atomically; public fsspec helpers",
    "_is_local_file_protocol": "same",
    "_load": "same",
    "_set_sampler_epoch": "set the epoch on a replaced sampler as the fit loop does; a public helper",
    "_DataFetcher": "where the fit loop's data position lives; a data-position API on the fit loop",
    "_DataLoaderIterDataFetcher": "same",
    "_data_fetcher": "same",
    "_combined_loader": "same",
    "_load_state_dicts": "restore the stateful dataloaders' states (exactly-once resume); same",
    "_BatchProgress": "the batch counters a position is restored to; the same",
    "_should_accumulate": "a batch without an optimizer step holds no vote; an accumulating property",
    "_batches_that_stepped": "the logging step, aligned to the committed step after a heal; a settable one",
    "_logger_connector": "whether this batch's metrics are logged; trainer.should_log",
    "_checkpoint_connector": "resume_start, dump_checkpoint and the restores of a heal; a resume hook, "
    "Trainer.dump_checkpoint/restore",
    "_loaded_checkpoint": "the checkpoint the connector restores from; Trainer.restore(checkpoint)",
    "_make_pruning_permanent": "off while a heal builds its checkpoint; an argument settable per save",
    "_on_before_batch_transfer": "the user's batch hook, run where the exactly-once batch is checked; a public runner",
    "_device_mesh": "FSDP2's group mesh, as ModelParallelStrategy sets it; a settable device_mesh",
    "_val_check_time_interval": "a validation cadence given as a duration; a public val_check_interval",
    "_enable_version_counter": "one file name per step across replica groups; the argument, settable",
    "_sync_module_states": "FSDP2 setup as Lightning's strategies do; public setup helpers",
    "_optimizers_to_device": "same",
    "_layer_sync": "the layer sync plugin; a layer_sync property",
    "_sampler": "the user's sampler inside DistributedSamplerWrapper; a public sampler attribute",
    "_optimizer": "the optimizer inside a LightningOptimizer; a public optimizer attribute",
    "_configure_launcher": "no launcher (no process observer thread) for a one-process group (strategy.py); "
    "a launcher option",
    "_launcher": "same",
    "_setup_model": "leave a model frozen at the start unwrapped (strategy.py); a DDP-wrapping hook",
    "_register_ddp_hooks": "the cross-group comm hook in place of Lightning's (strategy.py); a comm-hook hook",
    "_ddp_kwargs": "the DDP arguments, in the strategy's contract across groups (strategy.py), "
    "find_unused_parameters resolved per model; a ddp_kwargs property",
}


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether this training batch only accumulates gradients (no optimizer step)."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def data_fetcher(trainer: pl.Trainer) -> Any:
    """The fit loop's data fetcher (``None`` before the loop set it up)."""
    return trainer.fit_loop._data_fetcher


def combined_loader(trainer: pl.Trainer) -> Any:
    """The fit loop's combined loader (``None`` before the loop set it up)."""
    return trainer.fit_loop._combined_loader


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning logs this batch's metrics at."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def set_batches_that_stepped(trainer: pl.Trainer, steps: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = steps


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning logs this batch's metrics (its ``log_every_n_steps`` rule)."""
    return bool(trainer._logger_connector.should_update_logs)


def checkpoint_connector(trainer: pl.Trainer) -> Any:
    """The trainer's checkpoint connector, whose ``resume_start`` loads the start checkpoint."""
    return trainer._checkpoint_connector


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint ``Trainer.save_checkpoint`` would write now, in memory: every ``state_dict()`` and every
    ``on_save_checkpoint`` hook (module, datamodule, callbacks, precision plugin), through Lightning's own code."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return checkpoint


@contextmanager
def pruning_kept_as_trained(trainer: pl.Trainer) -> Iterator[None]:
    """``ModelPruning`` makes pruning permanent in the checkpoint it writes (by default): the file holds the pruned
    weights without their masks, an export. A heal needs the state as the group trains it, masks included, so that
    export is off while the block runs. (The sender builds a heal's checkpoint while its training thread computes
    the step or waits for the quorum, never while it saves a checkpoint file: those saves come after the vote.)"""
    pruners = [
        callback
        for callback in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(callback, ModelPruning) and callback._make_pruning_permanent
    ]
    for callback in pruners:
        callback._make_pruning_permanent = False
    try:
        yield
    finally:
        for callback in pruners:
            callback._make_pruning_permanent = True


def restore_from_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Restore an in-memory checkpoint as ``Trainer.fit(ckpt_path=...)`` restores a file, in its order and with its
    hooks: the datamodule, the module (``on_load_checkpoint``, then the weights), the callbacks (``on_load_checkpoint``,
    then ``load_state_dict``), the precision plugin, the optimizers and LR schedulers. Not the loops: Lightning
    restores those for a restart (it marks them as restarting), and a heal lands between two batches."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_datamodule()
        connector.restore_model()
        connector.restore_callbacks()
        connector.restore_precision_plugin_state()
        connector.restore_optimizers_and_schedulers()
    finally:
        connector._loaded_checkpoint = {}


def run_on_before_batch_transfer(module: pl.LightningModule, batch: Any, dataloader_idx: int) -> Any:
    """The module's ``on_before_batch_transfer`` as Lightning runs it (through the trainer's hook runner)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Make ``mesh`` the module's ``device_mesh``, as Lightning's ModelParallelStrategy does."""
    module._device_mesh = mesh


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The DDP strategy's keyword arguments for torch's ``DistributedDataParallel`` (the dict itself: a setting
    resolved per model is written into it before DDP wraps the model)."""
    return strategy._ddp_kwargs


def layer_sync(strategy: Any) -> Any:
    """The strategy's layer sync plugin (``Trainer(sync_batchnorm=True)``), or ``None``."""
    return strategy._layer_sync


VERSION_COUNTER = "_enable_version_counter"  # ModelCheckpoint's attribute (set through LoopPatches, undone after)


def version_counter_on(callback: ModelCheckpoint) -> bool:
    """Whether a ModelCheckpoint adds ``-v1`` to a file name that exists."""
    return bool(getattr(callback, VERSION_COUNTER))


def load_loader_states(combined_loader: Any, states: list[dict[str, Any]]) -> None:
    """Give each of a ``CombinedLoader``'s dataloaders its saved state (the stateful ones), before it iterates."""
    combined_loader._load_state_dicts(states)


def custom_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``."""
    return sampler.dataset._sampler


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer inside a ``LightningOptimizer`` (any other optimizer as it is)."""
    return getattr(optimizer, "_optimizer", optimizer)


def val_check_time_interval(trainer: pl.Trainer) -> float | None:
    """The validation cadence in seconds, when ``val_check_interval`` was given as a duration (else None)."""
    seconds = getattr(trainer, "_val_check_time_interval", None)
    return float(seconds) if seconds is not None else None

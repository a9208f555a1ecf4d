"""What one job's contract holds: the settings that every replica group of a job must share, read from a group's
Trainer and FTStrategy, each as a short text that compares exactly and reads well in an error.

:func:`describe_job` reads Lightning's (stop conditions, the step, the data, validation, the model's structure, the
callbacks whose state the checkpoint holds); :func:`strategy_contract` says which of FTStrategy's own settings belong.
What may differ between groups is left out on purpose (:data:`MAY_DIFFER_CALLBACKS`, and every setting not named
here: paths, loggers, timeouts, addresses). :mod:`lightning_ft.start.contract` compares them across groups.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    Checkpoint,
    DeviceStatsMonitor,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

from lightning_ft import lightning_internals
from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.errors import LightningFTError
from lightning_ft.hsdp.data_parallel import DataParallelSettings
from lightning_ft.settings import FTConfigError, FTSettings

# The key of the job's settings among the states a heal carries (torchft's user state dict).
CONTRACT_KEY = "lightning_ft_job_contract"

# Callbacks that write, show or save, and do not change what is trained: they may differ between groups (a group may
# keep its own checkpoints, at its own cadence, in its own folder).
MAY_DIFFER_CALLBACKS: tuple[type[pl.Callback], ...] = (
    Checkpoint,
    ProgressBar,
    ModelSummary,
    LearningRateMonitor,
    DeviceStatsMonitor,
)


class JobContractError(LightningFTError, ValueError):
    """This replica group is set up for another job than its peers: a setting that every group must share differs.

    Raised at the job's first quorum in the group that differs (``docs/your-code.md``, what every group must agree
    on); the message names each setting, its value here and there.
    """


@dataclass(frozen=True)
class JobContract:
    """The settings that decide what one job trains, each as a short, comparable text."""

    settings: dict[str, str]

    def differences(self, other: JobContract) -> list[tuple[str, str, str]]:
        """``(setting, this value, other value)`` for each setting that differs, in a fixed order."""
        names = sorted(set(self.settings) | set(other.settings))
        missing = "(not set)"
        return [
            (name, self.settings.get(name, missing), other.settings.get(name, missing))
            for name in names
            if self.settings.get(name) != other.settings.get(name)
        ]

    def to_bytes(self, group: int) -> bytes:
        return json.dumps({"group": group, "settings": self.settings}, sort_keys=True).encode()

    @staticmethod
    def from_bytes(payload: bytes) -> tuple[int, JobContract]:
        decoded = json.loads(payload.decode())
        return int(decoded["group"]), JobContract(dict(decoded["settings"]))


def describe_job(trainer: pl.Trainer, strategy_settings: dict[str, Any]) -> JobContract:
    """The job's contract as this group sees it: Lightning's settings from ``trainer``, and the strategy's own that
    must agree. Read once the training loader is set up (batch size, batches per epoch)."""
    fit_loop = trainer.fit_loop
    settings: dict[str, Any] = {
        "max_steps": trainer.max_steps,
        "max_epochs": trainer.max_epochs,
        "min_steps": fit_loop.min_steps,
        "min_epochs": trainer.min_epochs,
        "max_time": _max_time(trainer),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "precision": trainer.precision,
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
        "train batch size": _batch_sizes(trainer.train_dataloader),
        "train batches per epoch": trainer.num_training_batches,
        # A duration leaves Lightning's batch interval unset (its seconds are kept apart).
        "val_check_interval": getattr(trainer, "val_check_interval", None),
        "val_check_interval seconds": lightning_internals.val_check_time_interval(trainer),
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
        "limit_val_batches": trainer.limit_val_batches,
        "model structure": _model_structure(trainer.lightning_module),
        "callbacks": _stateful_callbacks(trainer),
    }
    settings.update({f"FTStrategy {name}": value for name, value in strategy_settings.items()})
    return JobContract({name: _text(value) for name, value in settings.items()})


def strategy_contract(
    settings: FTSettings,
    algorithm: AlgorithmSettings,
    data_parallel: DataParallelSettings,
    data_mode: str,
    ddp_kwargs: Mapping[str, Any],
    group_size: int,
) -> dict[str, Any]:
    """FTStrategy's settings that every group must share: those that decide the job's data shards, which steps
    commit, how groups synchronise and how gradients are laid out for the cross-group allreduce. The others (the
    group's id, addresses, timeouts, the lighthouse) are the group's own."""
    contract: dict[str, Any] = {
        "num_replica_groups": settings.num_replica_groups,
        "processes per group": group_size,
        "min_replica_size": settings.min_replica_size,
        "world_size_mode": settings.world_size_mode,
        "init_sync": settings.init_sync,
        "use_async_quorum": settings.use_async_quorum,
        "skip_non_finite_steps": settings.skip_non_finite_steps,
        "buffer_sync": settings.buffer_sync,
        "process_group": settings.process_group,
        "checkpoint_transport": settings.checkpoint_transport,
        "data_mode": data_mode,
        "algorithm": algorithm.algorithm,
        "sync_every": algorithm.sync_every,
        "outer_optimizer": algorithm.outer_optimizer,
        "fragments": algorithm.fragments,
        "fragment_sync_delay": algorithm.fragment_sync_delay,
        "fragment_update_alpha": algorithm.fragment_update_alpha,
        "quantize": algorithm.quantize,
        "data_parallel": data_parallel.data_parallel,
        "fsdp": repr(data_parallel.fsdp) if data_parallel.fsdp is not None else None,
    }
    # The gradient bucket layout: DDP's buckets are what crosses groups, one allreduce each.
    for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
        contract[name] = ddp_kwargs.get(name)
    return contract


def _text(value: Any) -> str:
    """A value as the error shows it, the same text in every process for the same value (no addresses)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_text(item)}" for key, item in sorted(value.items())) + "}"
    if callable(value):
        return str(getattr(value, "__qualname__", type(value).__qualname__))
    return repr(value)


def _max_time(trainer: pl.Trainer) -> float | None:
    """``Trainer(max_time=...)`` in seconds: Lightning keeps it in its ``Timer`` callback, whose remaining and elapsed
    times add up to it."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # a list of callbacks at runtime
        if isinstance(callback, Timer):
            remaining = callback.time_remaining()
            return None if remaining is None else round(remaining + callback.time_elapsed())
    return None


def _batch_sizes(loaders: Any) -> list[int | None]:
    """The batch size of each training loader (``trainer.train_dataloader``: one, or a collection of them)."""
    return [_batch_size(loader) for loader in _loaders(loaders)]


def _loaders(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _loaders(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _loaders(item)
    elif value is not None:
        yield value


def _batch_size(loader: Any) -> int | None:
    if isinstance(loader, DataLoader):
        if loader.batch_size is not None:
            return loader.batch_size
        return getattr(loader.batch_sampler, "batch_size", None)
    return getattr(loader, "batch_size", None)


def _model_structure(module: pl.LightningModule) -> str:
    """Every parameter's and buffer's name, shape and dtype, as a count and a digest (the same in every group of one
    job; an FSDP shard reports its whole parameter's shape)."""
    entries = [
        f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}"
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
        for name, tensor in named
    ]
    elements = sum(tensor.numel() for tensor in module.parameters())
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:12]
    return f"{len(entries)} tensors, {elements} parameter elements, digest {digest}"


def _stateful_callbacks(trainer: pl.Trainer) -> list[str]:
    """The callbacks whose state Lightning's checkpoint holds (a ``state_dict()`` or an ``on_save_checkpoint``), by
    ``state_key``, except those that may differ between groups (:data:`MAY_DIFFER_CALLBACKS`) and Lightning's
    ``Timer``, whose one setting is ``max_time``."""
    keys = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # a list of callbacks at runtime
        if isinstance(callback, (*MAY_DIFFER_CALLBACKS, Timer)):  # Timer: compared as max_time
            continue
        if callback.state_dict() or is_overridden("on_save_checkpoint", callback, pl.Callback):
            keys.append(str(callback.state_key))  # a key is any hashable (a type, for Lightning's own tests)
    return sorted(keys)


def refuse_group_local_settings(trainer: pl.Trainer, num_replica_groups: int) -> None:
    """Raise :class:`~lightning_ft.settings.FTConfigError` for a Lightning setting that each group would apply on its
    own, at a different step, in a job of several groups: a validation cadence given as a duration (each group's clock
    would start validation, a job-wide section, at another step)."""
    seconds = lightning_internals.val_check_time_interval(trainer)
    if num_replica_groups > 1 and seconds is not None:
        raise FTConfigError(
            f"lightning-ft: Trainer(val_check_interval=...) is a duration ({seconds:g} s): each replica group would "
            f"validate when its own clock says, at another step than its peers, while validation runs in step across "
            f"the job. Give val_check_interval as a number of batches (an int) or a fraction of the epoch."
        )

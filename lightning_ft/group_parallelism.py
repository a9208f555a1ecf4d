"""Data parallelism inside a replica group, by composition: DDP or FSDP2, two objects behind one interface.

FTStrategy is a ``DDPStrategy`` whose group-local hooks (setup, the backward-sync switch, the model and optimizer
state for checkpoints) delegate to its :class:`GroupParallelism`: :class:`GroupDDP` runs ``DDPStrategy``'s own, and
:class:`~lightning_ft.hsdp.in_group.GroupFSDP` shards the model with FSDP2 in place of DDP's wrapper (HSDP across
groups, ``docs/hsdp.md``). Which one is decided once, from ``FTStrategy(data_parallel=...)``
(:func:`group_parallelism`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_ft.hsdp.cross_group import ShardAverage
from lightning_ft.hsdp.data_parallel import DataParallelSettings
from lightning_ft.hsdp.in_group import GroupFSDP


class GroupParallelism(Protocol):
    """What FTStrategy delegates to the data parallelism inside its replica group. Each method takes the strategy
    (a ``DDPStrategy``), whose Lightning state (accelerator, model, optimizers, precision plugin) it works on."""

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The group's 1-D mesh when the model is sharded over it (``None`` with DDP)."""
        ...

    def setup_environment(self, strategy: DDPStrategy) -> None:
        """After the group's process group exists, before ``configure_model()``."""
        ...

    def setup(self, strategy: DDPStrategy, trainer: pl.Trainer) -> None:
        """``Strategy.setup``: the model wrapped (or sharded), the optimizers and the precision plugin set up."""
        ...

    def block_backward_sync(self, strategy: DDPStrategy) -> AbstractContextManager[None]:
        """No gradient sync inside the group while accumulating."""
        ...

    def backward_done(self) -> None:
        """After each backward pass, before the optimizer step: gradient work the data parallelism leaves to the end."""
        ...

    def lightning_module_state_dict(self, strategy: DDPStrategy) -> dict[str, Any]: ...

    def optimizer_state(self, strategy: DDPStrategy, optimizer: Optimizer) -> dict[str, Any]: ...

    def load_model_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any], strict: bool) -> None: ...

    def load_optimizer_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any]) -> None: ...


class GroupDDP:
    """Every rank of the group holds a full replica, wrapped in torch's DDP: ``DDPStrategy``'s own hooks."""

    device_mesh: DeviceMesh | None = None

    def setup_environment(self, strategy: DDPStrategy) -> None:
        pass

    def setup(self, strategy: DDPStrategy, trainer: pl.Trainer) -> None:
        DDPStrategy.setup(strategy, trainer)

    @contextmanager
    def block_backward_sync(self, strategy: DDPStrategy) -> Iterator[None]:
        with DDPStrategy.block_backward_sync(strategy):
            yield

    def backward_done(self) -> None:
        """Nothing: DDP's buckets cross groups in its comm hook, which finishes them (``FTCommState.backward_done``)."""

    def lightning_module_state_dict(self, strategy: DDPStrategy) -> dict[str, Any]:
        return DDPStrategy.lightning_module_state_dict(strategy)

    def optimizer_state(self, strategy: DDPStrategy, optimizer: Optimizer) -> dict[str, Any]:
        return DDPStrategy.optimizer_state(strategy, optimizer)

    def load_model_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any], strict: bool) -> None:
        DDPStrategy.load_model_state_dict(strategy, checkpoint, strict=strict)

    def load_optimizer_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any]) -> None:
        DDPStrategy.load_optimizer_state_dict(strategy, checkpoint)


def group_parallelism(
    settings: DataParallelSettings, shard_average: Callable[[nn.Module], ShardAverage]
) -> GroupParallelism:
    """The group's data parallelism for ``FTStrategy(data_parallel=...)``. ``shard_average`` makes FSDP2's
    cross-group average (DDP's comm hook is registered by the strategy's ``_register_ddp_hooks``)."""
    if not settings.sharded:
        return GroupDDP()
    assert settings.fsdp is not None
    return GroupFSDP(settings.fsdp, shard_average)

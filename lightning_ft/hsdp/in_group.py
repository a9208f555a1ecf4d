"""FSDP2 inside a replica group (``data_parallel="fsdp"``): the model is sharded over the group in place of DDP's
wrapper, and each module's reduced shards are averaged across groups (HSDP, ``docs/hsdp.md``;
:mod:`lightning_ft.hsdp.cross_group`). FTStrategy delegates its
group-local hooks to this object (:mod:`lightning_ft.group_parallelism`), as it does to ``GroupDDP`` with DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_ft import lightning_internals
from lightning_ft.errors import attached_module
from lightning_ft.hsdp import full_state as sharded_checkpoint
from lightning_ft.hsdp.cross_group import ShardAverage
from lightning_ft.hsdp.data_parallel import FSDPSettings
from lightning_ft.hsdp.sharding import gradient_sync_off, group_mesh, is_sharded, shard_module


class GroupFSDP:
    """Each rank of the group holds a shard of the model and optimizer state (FSDP2 over the group's 1-D mesh).

    Args:
        settings: The ``fsdp_*`` settings.
        shard_average: Makes the cross-group average of the sharded model's gradients; called at setup, once the
            Manager exists (:class:`lightning_ft.hsdp.cross_group.ShardAverage`).
    """

    def __init__(self, settings: FSDPSettings, shard_average: Callable[[nn.Module], ShardAverage]) -> None:
        self._settings = settings
        self._shard_average = shard_average
        self._average: ShardAverage | None = None
        self._mesh: DeviceMesh | None = None

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._mesh

    def setup_environment(self, strategy: DDPStrategy) -> None:
        """The group's mesh, before ``configure_model()``, which may shard over ``self.device_mesh``."""
        self._mesh = group_mesh(strategy.root_device)
        lightning_internals.set_device_mesh(attached_module(strategy), self._mesh)

    def setup(self, strategy: DDPStrategy, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` with FSDP2 sharding in place of the DDP wrapper. The model is sharded only when
        fitting (as DDP only wraps then), unless ``configure_model`` sharded it; a model that is not sharded gets
        DDP's broadcast of rank 0's weights when not fitting (a sharded one must not)."""
        assert strategy.accelerator is not None and strategy.model is not None
        strategy.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = lightning_internals.layer_sync(strategy)
        if fitting and layer_sync:
            strategy.model = layer_sync.apply(strategy.model)
        strategy.precision_plugin.convert_module(strategy.model)
        strategy.model_to_device()
        if fitting:
            assert self._mesh is not None
            module = attached_module(strategy)
            shard_module(module, self._mesh, self._settings)
            self._average = self._shard_average(module)
            self._average.install()
            strategy.setup_optimizers(trainer)
        elif not is_sharded(strategy.model):
            lightning_internals.sync_module_states(strategy.model)
        strategy.setup_precision_plugin()
        if fitting:
            lightning_internals.optimizers_to_device(strategy.optimizers, strategy.root_device)

    def backward_done(self) -> None:
        """After each backward pass: the shards cross groups, what the group left out as zeros."""
        if self._average is not None:
            self._average.backward_done()

    @contextmanager
    def block_backward_sync(self, strategy: DDPStrategy) -> Iterator[None]:
        if strategy.model is None:
            yield
            return
        with gradient_sync_off(strategy.model):
            yield

    def lightning_module_state_dict(self, strategy: DDPStrategy) -> dict[str, Any]:
        """The full (unsharded) model state, gathered for group rank 0."""
        return sharded_checkpoint.full_model_state(attached_module(strategy))

    def optimizer_state(self, strategy: DDPStrategy, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name, gathered for group rank 0."""
        optimizer = lightning_internals.unwrapped_optimizer(optimizer)  # a LightningOptimizer
        return sharded_checkpoint.full_optimizer_state(attached_module(strategy), optimizer)

    def load_model_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any], strict: bool) -> None:
        sharded_checkpoint.load_full_model_state(attached_module(strategy), checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, strategy: DDPStrategy, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(strategy.optimizers, checkpoint["optimizer_states"], strict=False):
            sharded_checkpoint.load_full_optimizer_state(attached_module(strategy), optimizer, state)

"""FTStrategy's overrides for ``data_parallel="fsdp"``: FSDP2 shards the model inside the group in place of DDP's
wrapper, and each reduced shard is averaged across groups (HSDP, ``docs/hsdp.md``).

Each override falls through to ``DDPStrategy`` when the group is not sharded; :class:`~lightning_ft.FTStrategy`
derives from this class, which is not a strategy of its own.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torchft import Manager
from typing_extensions import override

from lightning_ft import lightning_internals as lightning
from lightning_ft.hsdp import full_state as sharded_checkpoint
from lightning_ft.hsdp.data_parallel import DataParallelSettings
from lightning_ft.hsdp.sharding import fsdp_modules, gradient_sync_off, is_sharded, shard_module
from lightning_ft.step.gradient_hooks import fsdp_cross_group_hook
from lightning_ft.step.protocol import StepProtocol


class ShardedGroupHooks(DDPStrategy):
    """The FSDP2 half of FTStrategy's hook overrides (``data_parallel``, ``manager`` and ``step_protocol`` are
    FTStrategy's)."""

    data_parallel: DataParallelSettings
    _device_mesh: DeviceMesh | None
    manager: Manager

    @property
    def step_protocol(self) -> StepProtocol:
        raise NotImplementedError  # FTStrategy's

    @property
    def _module(self) -> pl.LightningModule:
        """``lightning_module``, which Lightning attaches before it calls any of these hooks."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("FTStrategy: no LightningModule is attached yet.")
        return module

    @property
    def device_mesh(self) -> DeviceMesh:
        """The replica group's 1-D mesh (``data_parallel="fsdp"`` only), also ``LightningModule.device_mesh``."""
        if self._device_mesh is None:
            raise RuntimeError("FTStrategy.device_mesh exists with data_parallel='fsdp', after setup_environment().")
        return self._device_mesh

    def _setup_sharded(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` with FSDP2 sharding in place of the DDP wrapper. The model is sharded only when
        fitting (as DDP only wraps then), unless ``configure_model`` sharded it; a model that is not sharded gets
        DDP's broadcast of rank 0's weights when not fitting (a sharded one must not)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            assert self.data_parallel.fsdp is not None and self._device_mesh is not None
            shard_module(self._module, self._device_mesh, self.data_parallel.fsdp)
            hook = fsdp_cross_group_hook(self.manager, before_allreduce=self.step_protocol.before_cross_group_allreduce)
            for fsdp_module in fsdp_modules(self._module):
                fsdp_module.set_all_reduce_hook(hook)
            self.setup_optimizers(trainer)
        elif not is_sharded(self.model):
            lightning.sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            lightning.optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if not self.data_parallel.sharded or self.model is None:
            with super().block_backward_sync():
                yield
            return
        with gradient_sync_off(self.model):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """With FSDP, the full (unsharded) model state, gathered for group rank 0."""
        if not self.data_parallel.sharded:
            return super().lightning_module_state_dict()
        return sharded_checkpoint.full_model_state(self._module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """With FSDP, the full optimizer state keyed by parameter name, gathered for group rank 0."""
        if not self.data_parallel.sharded:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return sharded_checkpoint.full_optimizer_state(self._module, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.data_parallel.sharded:
            return super().load_model_state_dict(checkpoint, strict=strict)
        sharded_checkpoint.load_full_model_state(self._module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.data_parallel.sharded:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            sharded_checkpoint.load_full_optimizer_state(self._module, optimizer, state)

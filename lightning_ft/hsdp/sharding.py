"""Shard a LightningModule with FSDP2 inside its replica group: the user's ``configure_model``, or an auto-wrap policy.

The group's mesh is a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` over the group's own default process
group, which never leaves the group (see :mod:`lightning_ft.strategy`). Nothing here crosses groups: FSDP2's
all-gathers and reduce-scatters run on that mesh, and the cross-group average follows each module's reduction
(:mod:`~lightning_ft.hsdp.cross_group`).

Two ways to shard, never both:

* ``configure_model`` called ``fully_shard`` itself: that layout is kept as it is. The ``fsdp_*`` sharding options are
  then refused, because they would silently do nothing.
* Otherwise the auto-wrap policy of :class:`~lightning_ft.hsdp.data_parallel.FSDPSettings` gives the listed module
  classes (and modules above the size threshold) their own ``fully_shard``, bottom-up, and the LightningModule itself
  last.

Either way every parameter must end up managed by FSDP2: a parameter outside every ``fully_shard`` would never have
its gradient reduced and the replicas would drift apart. When ``configure_model`` left some out, the LightningModule
itself is sharded as the catch-all. Whenever the LightningModule is a root ``fully_shard``, its step methods
(``training_step`` & co.) are registered as FSDP forward methods, because Lightning calls them instead of
``forward``, and FSDP2 only all-gathers a root's parameters around a forward.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from lightning_ft.errors import NotAvailableError, UnsupportedModelError
from lightning_ft.hsdp.data_parallel import FSDPSettings
from lightning_ft.settings import FTConfigError

log = logging.getLogger("lightning.pytorch.lightning_ft")

MESH_DIM = "data_parallel"
# The LightningModule methods Lightning calls in place of forward.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_REGISTERED_MARK = "_lightning_ft_fsdp_forward_methods"
_AUTO_WRAPPED_MARK = "_lightning_ft_auto_wrapped"


def group_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over this replica group's default process group (named ``"data_parallel"``, as in Lightning's
    ``ModelParallelStrategy``), made from the existing group so that no new process group is created."""
    world = dist.group.WORLD
    if world is None:
        raise NotAvailableError(
            "FTStrategy(data_parallel='fsdp'): the replica group's process group is not initialized."
        )
    return DeviceMesh.from_group(world, device.type, mesh_dim_names=(MESH_DIM,))


def fsdp_modules(module: nn.Module) -> Iterator[FSDPModule]:
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            yield submodule


@contextmanager
def gradient_sync_off(module: nn.Module) -> Iterator[None]:
    """Accumulation micro-batches keep FSDP2's unsharded gradients local: no reduce-scatter, no cross-group average,
    until the last micro-batch reduces their sum (DDP's ``no_sync`` for FSDP2)."""
    modules = list(fsdp_modules(module))
    for fsdp_module in modules:
        fsdp_module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for fsdp_module in modules:
            fsdp_module.set_requires_gradient_sync(True, recurse=False)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied anywhere in ``module``."""
    return next(fsdp_modules(module), None) is not None


def unmanaged_parameters(module: nn.Module) -> list[str]:
    """Parameters that no ``fully_shard`` manages (FSDP2 turns every parameter it manages into a DTensor)."""
    return [name for name, param in module.named_parameters() if not isinstance(param, DTensor)]


def shard_module(module: nn.Module, mesh: DeviceMesh, settings: FSDPSettings) -> None:
    """Shard ``module`` (the LightningModule) in place: keep ``configure_model``'s layout or apply the auto-wrap
    policy; make sure every parameter is managed; register the step methods as FSDP forward methods."""
    if vars(module).get(_AUTO_WRAPPED_MARK, False):
        return  # sharded by an earlier fit of this strategy (a second trainer.fit): FSDP2 sharding is in place
    if is_sharded(module):
        given = settings.sharding_options_given
        if given:
            raise FTConfigError(
                f"{', '.join(given)}: configure_model() already applied fully_shard, so FTStrategy keeps that layout "
                f"and these options would do nothing. Remove them, or pass the same choices to your own fully_shard "
                f"calls (mp_policy=, offload_policy=, reshard_after_forward=)."
            )
        left_out = unmanaged_parameters(module)
        if left_out and not isinstance(module, FSDPModule):
            log.info(
                "lightning-ft: configure_model() sharded part of the model; the LightningModule itself is sharded as "
                "well, for the %d parameter(s) outside every fully_shard (%s)",
                len(left_out),
                ", ".join(left_out[:5]) + (", ..." if len(left_out) > 5 else ""),
            )
            fully_shard(module, mesh=mesh)
    else:
        _auto_wrap(module, mesh, settings)
        vars(module)[_AUTO_WRAPPED_MARK] = True
    left_out = unmanaged_parameters(module)
    if left_out:  # the LightningModule is a fully_shard but its parameters are not DTensors: something else holds them
        raise UnsupportedModelError(
            f"lightning-ft: parameters {left_out} are not managed by FSDP2 after sharding, so their gradients would "
            f"never be averaged. Make sure configure_model() shards modules that contain them."
        )
    if isinstance(module, FSDPModule):
        register_step_methods(module)


def register_step_methods(module: FSDPModule) -> None:
    """Register the LightningModule's own step methods as FSDP forward methods (once per module object).

    Only the ones the LightningModule overrides: Lightning decides from that which loops to run.
    """
    registered: set[str] = vars(module).setdefault(_REGISTERED_MARK, set())
    for name in STEP_METHODS:
        if isinstance(module, pl.LightningModule) and not is_overridden(name, module):
            continue
        if name not in registered and hasattr(module, name):
            register_fsdp_forward_method(module, name)  # type: ignore[arg-type]
            registered.add(name)


def _auto_wrap(root: nn.Module, mesh: DeviceMesh, settings: FSDPSettings) -> None:
    """``fully_shard`` bottom-up: listed classes and modules over the size threshold, then the root."""
    classes = _resolve_wrap_classes(root, settings.wrap_classes)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": settings.mixed_precision,
        "offload_policy": settings.offload_policy,
        "reshard_after_forward": settings.reshard_after_forward,
    }
    wrapped = 0
    # named_modules() lists every module before its submodules, so the reverse visits submodules first.
    for name, submodule in reversed(list(root.named_modules())):
        if submodule is root:
            continue
        # Parameters a wrapped submodule already manages have become DTensors.
        own = [param for param in submodule.parameters() if not isinstance(param, DTensor)]
        if not own:
            continue
        listed = any(_matches(submodule, wanted) for wanted in classes)
        large = settings.min_params is not None and sum(param.numel() for param in own) >= settings.min_params
        if listed or large:
            fully_shard(submodule, **kwargs)
            wrapped += 1
            log.debug("lightning-ft: fully_shard(%s)", name)
    fully_shard(root, **kwargs)
    log.info("lightning-ft: FSDP2 sharded the model over %d process(es): %d module(s) + the root", mesh.size(), wrapped)


def _matches(module: nn.Module, wanted: type[nn.Module] | str) -> bool:
    if isinstance(wanted, str):
        return type(module).__name__ == wanted
    return isinstance(module, wanted)


def _resolve_wrap_classes(root: nn.Module, names: tuple[str, ...]) -> list[type[nn.Module] | str]:
    """``"package.module.Class"`` is imported (instances of it and its subclasses match); a bare ``"Class"``
    matches modules whose class has that exact name. A name that matches no module is refused: it is a typo."""
    resolved: list[type[nn.Module] | str] = []
    present = sorted({type(module).__name__ for module in root.modules() if module is not root})
    for name in names:
        wanted: type[nn.Module] | str = name
        if "." in name:
            module_name, _, attribute = name.rpartition(".")
            try:
                wanted = getattr(importlib.import_module(module_name), attribute)
            except (ImportError, AttributeError):
                raise FTConfigError(
                    f"fsdp_wrap: cannot import {name!r}. Give an importable class path such as "
                    f"'torch.nn.TransformerEncoderLayer', or a bare class name from the model: {', '.join(present)}."
                ) from None
            if not (isinstance(wanted, type) and issubclass(wanted, nn.Module)):
                raise FTConfigError(f"fsdp_wrap: {name!r} is not a torch.nn.Module class.")
        if not any(_matches(module, wanted) for module in root.modules() if module is not root):
            raise FTConfigError(
                f"fsdp_wrap: {name!r} matches no module of the model. Module classes in it: {', '.join(present)}."
            )
        resolved.append(wanted)
    return resolved

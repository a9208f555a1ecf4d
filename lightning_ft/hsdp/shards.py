"""Sharded state (DTensors) in the heal payload: sent as this rank's local shard, put back as a DTensor on arrival.

With FSDP2 the model's parameters and the optimizer's moments are DTensors, each rank holding its shard. torchft
heals rank *r* of a group from rank *r* of a live group (the checkpoint metadata is looked up by group rank), so
when every group has the same size and shards the same way, the shard a rank receives is exactly the one it holds.

Why not send the DTensors themselves: a DTensor carries its DeviceMesh, and the mesh's process group is a
different object in every process (the HTTP transport would pickle it, the process-group transport would rebuild
it from a spec that names the sender's mesh). Only the local tensor and enough metadata to check it are sent; the
receiver wraps it into a DTensor on its *own* mesh, after checking that the global shape, the placements and the
local shape all match. A mismatch (groups of different sizes, another model) is an
:class:`~lightning_ft.heal.state.IncompatibleReplicaError`-style failure, never a silent misload.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_ft.errors import LightningFTError

SHARD_KEY = "__lightning_ft_local_shard__"


class IncompatibleShardError(LightningFTError, RuntimeError):
    """A peer's shard does not fit this rank's (another group size, another sharding, another model)."""


def holds_shards(trainer: pl.Trainer) -> bool:
    """Whether each rank of this replica group holds only a shard of the state (``data_parallel="fsdp"``)."""
    settings = getattr(trainer.strategy, "data_parallel", None)
    return bool(getattr(settings, "sharded", False))


def is_shard(value: Any) -> bool:
    return isinstance(value, dict) and SHARD_KEY in value


def to_local_shards(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by ``{SHARD_KEY: local tensor, "global_shape": ..., "placements": ...}``.

    The local tensor is shared with the DTensor, not copied (:func:`lightning_ft.heal.state.capture_training_state`).
    Plain dicts and lists keep the payload a pytree that both transports walk.
    """
    if isinstance(tree, DTensor):
        return {
            SHARD_KEY: cast(DTensor, tree.detach()).to_local(),
            "global_shape": list(tree.shape),
            "placements": [str(placement) for placement in tree.placements],
        }
    if isinstance(tree, dict):
        return {key: to_local_shards(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local_shards(value) for value in tree)
    return tree


def _as_dtensor(shard: dict[str, Any], like: DTensor, where: str, same_shape_as_like: bool = True) -> DTensor:
    """Wrap a received local shard into a DTensor on ``like``'s mesh and placements, after checking that it fits."""
    local: torch.Tensor = shard[SHARD_KEY]
    placements = [str(placement) for placement in like.placements]
    if shard["placements"] != placements:
        raise IncompatibleShardError(
            f"{where} is placed {shard['placements']} on the peer but {placements} here: every replica group must "
            f"shard the model the same way."
        )
    shape = torch.Size(shard["global_shape"])
    if same_shape_as_like:
        if shape != like.shape:
            raise IncompatibleShardError(
                f"{where} has shape {tuple(shape)} on the peer but {tuple(like.shape)} here: every replica group must "
                f"build the same model."
            )
        if local.shape != like.to_local().shape:
            raise IncompatibleShardError(
                f"{where}: the peer's shard has shape {tuple(local.shape)} but this rank's has "
                f"{tuple(like.to_local().shape)}: every replica group must have the same number of processes."
            )
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=shape, stride=_contiguous_strides(shape)
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def model_from_local_shards(received: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A peer's model state dict with its shards wrapped like this rank's own (``module.state_dict()``) entries."""
    restored: dict[str, Any] = {}
    for name, value in received.items():
        if not is_shard(value):
            restored[name] = value
            continue
        mine = own.get(name)
        if not isinstance(mine, DTensor):
            raise IncompatibleShardError(
                f"parameter {name!r} is sharded on the peer but not here: every replica group must use "
                f"data_parallel='fsdp' with the same sharding."
            )
        restored[name] = _as_dtensor(value, mine, f"parameter {name!r}")
    return restored


def optimizer_from_local_shards(received: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """A peer's ``optimizer.state_dict()`` with its shards wrapped like the parameters they belong to.

    The parameter a state entry belongs to is found by torch's numbering (parameters in ``param_groups`` order),
    which is the same on every replica of the same model; this rank's own optimizer may not have any state yet.
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state: dict[Any, Any] = {}
    for index, entries in received["state"].items():
        if not 0 <= int(index) < len(params):
            raise IncompatibleShardError(
                f"the peer's optimizer has state for parameter {index}, but this one has {len(params)} parameters."
            )
        param = params[int(index)]

        def wrap(value: Any, key: str, param: torch.Tensor = param, index: Any = index) -> Any:
            if not is_shard(value):
                return value
            if not isinstance(param, DTensor):
                raise IncompatibleShardError(
                    f"optimizer state {key!r} of parameter {index} is only sharded on the peer."
                )
            return _as_dtensor(
                value,
                param,
                f"optimizer state {key!r} of parameter {index}",
                same_shape_as_like=list(param.shape) == value["global_shape"],
            )

        state[index] = {key: wrap(value, key) for key, value in entries.items()}
    return {**received, "state": state}

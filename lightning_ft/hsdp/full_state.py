"""Full (unsharded) model and optimizer state of an FSDP2 model, for checkpoint files and final-state fingerprints.

Lightning checkpoints under FTStrategy have one writer per job (rank 0 of the lowest participating group, see
``FTStrategy.is_checkpoint_writer``). With FSDP2 no single rank holds the state, so the group gathers it for its
rank 0 with torch's ``get_model_state_dict``/``get_optimizer_state_dict`` (``full_state_dict=True``): every rank of
every group takes part in the gather (it is a collective inside the group, and every group saves alike), and only
the writer writes. The file is an ordinary Lightning checkpoint: the model's keys are the LightningModule's own, and
the optimizer state is keyed by parameter name (torch's distributed-checkpoint convention). Loading spreads it back
into shards with ``set_model_state_dict``/``set_optimizer_state_dict``; every rank reads the same file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


def _options(*, rank0_only: bool, strict: bool = True) -> StateDictOptions:
    # cpu_offload=True keeps the gathered tensors on group rank 0 only (the others get empty dicts).
    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only, strict=strict)


def full_model_state(module: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded model state dict (a collective inside the group). Empty on ranks other than 0 if
    ``rank0_only``."""
    return get_model_state_dict(module, options=_options(rank0_only=rank0_only))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer, *, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded optimizer state dict, keyed by parameter name (a collective inside the group).

    An optimizer that has not stepped yet has no state; torch would create it with a zero-learning-rate step, which
    counts as a step for Adam, so an empty state is returned as it is instead.
    """
    if not optimizer.state:
        return optimizer.state_dict()
    return get_optimizer_state_dict(module, optimizer, options=_options(rank0_only=rank0_only))


def load_full_model_state(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load an unsharded model state dict into a sharded (or not yet sharded) module, on every rank."""
    set_model_state_dict(module, dict(state_dict), options=_options(rank0_only=False, strict=strict))


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load an unsharded, name-keyed optimizer state dict into the optimizer of a sharded module, on every rank."""
    if not state_dict.get("state"):
        optimizer.load_state_dict(dict(state_dict))  # saved before the first step: nothing to spread
        return
    set_optimizer_state_dict(module, optimizer, dict(state_dict), options=_options(rank0_only=False))

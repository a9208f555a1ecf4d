"""What "the training state" of a Lightning job is, for live transfer between replica groups: Lightning's checkpoint.

A healing group must leave the heal indistinguishable from its peer. Lightning already defines what that takes: the
dict that ``Trainer.save_checkpoint`` writes. The model, every optimizer and LR scheduler, the precision plugin
(GradScaler), the loops' progress, every callback's ``state_dict()``, and whatever the module, the datamodule and the
callbacks add in their ``on_save_checkpoint`` hooks and read back in ``on_load_checkpoint`` (``WeightAveraging``'s
averaged model, a module's own counters). So a heal *is* that checkpoint, built by Lightning's own code on the
sender and restored by Lightning's own code, in its order and with its hooks, on the healer, in memory
(:func:`~lightning_ft.lightning_internals.dump_checkpoint`,
:func:`~lightning_ft.lightning_internals.restore_from_checkpoint`). The strategy's part of it, the model's and the
optimizers' state, is this process's own while a heal runs (:mod:`lightning_ft.heal.checkpoint_mode`): with FSDP,
this rank's shards.

What of the checkpoint each group keeps its own is listed once, with the reason, in :data:`NOT_CARRIED` and
:data:`APPLIED_OWN_WAY`. Everything a heal carries arrives through torch's ``weights_only=True`` unpickler (see
:mod:`lightning_ft.manager`), so what callbacks and hooks put in the checkpoint must be plain data (tensors, numbers,
strings, containers), as for a checkpoint file loaded with ``weights_only=True``.

The committed step itself travels in torchft's own part of the payload (``Manager.state_dict()``), and Lightning's
step counters are derived from it (:func:`align_step_counters`). The data position travels beside this state, under
its own key: each group reads its own shard, so what a healing group takes from its peer is the *loop position*
(epoch and batch counters), and it then moves its iterator to that position in its own shard
(:class:`~lightning_ft.callbacks.DataPositionCallback`). Every group thus stays at the same batch index, which
validation, epoch ends and cross-group metrics depend on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ft import lightning_internals
from lightning_ft.errors import LightningFTError, NotAvailableError
from lightning_ft.heal.checkpoint_mode import HealCheckpointMode
from lightning_ft.hsdp.full_state import full_model_state, full_optimizer_state
from lightning_ft.hsdp.shards import (
    IncompatibleShardError,
    holds_shards,
    model_from_local_shards,
    optimizer_from_local_shards,
)

STATE_KEY = "lightning"

#: The keys of Lightning's checkpoint that a heal leaves out, and why.
NOT_CARRIED: Mapping[str, str] = {
    "hyper_parameters": "the module's constructor arguments: each group's own code passed them, and they need not be "
    "plain data",
    "hparams_name": "names the module's hyper_parameters",
    "hparams_type": "the type of the module's hyper_parameters",
    "datamodule_hyper_parameters": "the datamodule's constructor arguments, as the module's",
}

#: The keys a heal carries but each group applies its own way, and why.
APPLIED_OWN_WAY: Mapping[str, str] = {
    "epoch": "follows the loops' epoch progress, which the heal loads",
    "global_step": "follows the Manager's committed step (semi-synchronously, the sync state's step counters)",
    "loops": "only the fit loop's epoch progress travels and is loaded: the batch position is each group's own place "
    "in its own shard (DataPositionCallback moves it), and Lightning's loop restore is for a restart",
}


class IncompatibleReplicaError(LightningFTError, RuntimeError):
    """A peer's training state does not fit this replica (other model, other optimizers). Never loaded silently."""


def heal_mode(trainer: pl.Trainer) -> HealCheckpointMode:
    """The strategy's :class:`HealCheckpointMode`: a heal needs FTStrategy."""
    mode = getattr(trainer.strategy, "heal_mode", None)
    if not isinstance(mode, HealCheckpointMode):
        raise NotAvailableError(
            f"a live heal needs Trainer(strategy=FTStrategy()), not {type(trainer.strategy).__name__}."
        )
    return mode


def capture_training_state(trainer: pl.Trainer, committed_buffers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Lightning's checkpoint of this replica, as a peer needs it to continue exactly where this replica is. Tensors
    are shared, not copied.

    Sharing is safe: torchft serves the staged state only until ``should_commit()``, which waits for every reader
    before the optimizer is allowed to step. Buffers are another matter: the forward pass changes them while the
    state is sent, so ``committed_buffers`` (:meth:`~lightning_ft.step.buffers.ModelBuffers.committed_state`) replace
    the live ones that the model's state holds.
    """
    with (
        heal_mode(trainer).open(holds_shards(trainer), committed_buffers),
        lightning_internals.pruning_kept_as_trained(trainer),
    ):
        checkpoint = lightning_internals.dump_checkpoint(trainer)
    carried = {key: value for key, value in checkpoint.items() if key not in NOT_CARRIED}
    # Lightning's dump read the loops' whole state (a stateful loader's state_dict() included, a read); a heal keeps
    # the epoch progress only (APPLIED_OWN_WAY).
    carried["loops"] = {"fit_loop": {"epoch_progress": trainer.fit_loop.epoch_progress.state_dict()}}
    return carried


def check_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> dict[str, Any]:
    """Raise :class:`IncompatibleReplicaError` if a peer's state does not fit this replica; load nothing.

    Returns the state ready to load (with FSDP, the received local shards wrapped as this replica's DTensors).
    The Manager runs this check before the healing replica's first cross-group collective (see
    :class:`~lightning_ft.manager.FTManager`), because a model of another shape would otherwise reach the
    gradient allreduce first, where mismatched sizes abort the *healthy* peer's process inside Gloo.
    """
    if holds_shards(trainer):
        state = _from_local_shards(trainer, state)
    _check_compatible(trainer, state)
    return state


def apply_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Restore a peer's checkpoint into this replica as Lightning restores one, refusing anything that does not
    match its structure before anything loads."""
    state = check_training_state(trainer, state)
    scale_before = _loss_scale(trainer)
    with heal_mode(trainer).open(holds_shards(trainer)):
        lightning_internals.restore_from_checkpoint(trainer, state)
    _rescale_unscaled_gradients(trainer, scale_before, _loss_scale(trainer))
    trainer.fit_loop.epoch_progress.load_state_dict(state["loops"]["fit_loop"]["epoch_progress"])


def _loss_scale(trainer: pl.Trainer) -> float | None:
    """GradScaler's current loss scale (``16-mixed``), or ``None`` without one."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def _rescale_unscaled_gradients(trainer: pl.Trainer, before: float | None, after: float | None) -> None:
    """Make the step's gradients unscaled by the loss scale just received, not the one this replica had.

    With an asynchronous quorum a group heals inside the commit vote, after GradScaler has unscaled the step's
    averaged gradient by this group's own (stale) scale. The gradient was scaled by the participants' scale, which
    the heal just loaded: the peers divide by that one, so this replica must too, or it applies another update. Loss
    scales are powers of two, so the correction is exact. (Before the forward pass, with a synchronous quorum, the
    gradients present are the previous step's, which are zeroed before use: the correction changes nothing there.)
    """
    if before is None or after is None or before == after:
        return
    factor = before / after
    with torch.no_grad():
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(factor)


def _from_local_shards(trainer: pl.Trainer, state: dict[str, Any]) -> dict[str, Any]:
    if len(state["optimizer_states"]) != len(trainer.optimizers):
        _check_compatible(trainer, state)  # raises, naming the counts
    try:
        return {
            **state,
            "state_dict": model_from_local_shards(state["state_dict"], trainer.lightning_module.state_dict()),
            "optimizer_states": [
                optimizer_from_local_shards(optimizer_state, optimizer)
                for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizer_states"], strict=True)
            ],
        }
    except IncompatibleShardError as error:
        raise IncompatibleReplicaError(str(error)) from error


def _check_compatible(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    for key, name, mine in (
        ("optimizer_states", "optimizers", trainer.optimizers),
        ("lr_schedulers", "lr_schedulers", trainer.lr_scheduler_configs),
    ):
        if len(state[key]) != len(mine):
            raise IncompatibleReplicaError(
                f"the peer has {len(state[key])} {name} but this replica has {len(mine)}: every replica group must "
                f"run the same LightningModule and configure_optimizers()."
            )
    peer_model: dict[str, torch.Tensor] = state["state_dict"]
    own_model = trainer.lightning_module.state_dict()
    missing = [name for name in own_model if name not in peer_model]
    unexpected = [name for name in peer_model if name not in own_model]
    if missing or unexpected:
        raise IncompatibleReplicaError(
            f"the peer's model does not match this replica's model: parameters only here: {_names(missing)}; "
            f"parameters only on the peer: {_names(unexpected)}. Every replica group must build the same model. "
            f"Nothing was loaded."
        )
    for name, tensor in own_model.items():
        peer = peer_model.get(name)
        if peer is not None and tuple(peer.shape) != tuple(tensor.shape):
            raise IncompatibleReplicaError(
                f"parameter {name!r} has shape {tuple(peer.shape)} on the peer but {tuple(tensor.shape)} here: "
                f"every replica group must build the same model. Nothing was loaded."
            )


def _names(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def align_step_counters(trainer: pl.Trainer, committed_steps: int) -> None:
    """Make ``trainer.global_step`` equal the number of committed steps.

    Lightning counts an optimizer step whenever the ``optimizer_step`` hook returns, whether or not the parameters
    changed. Under fault tolerance a step can be rejected by the commit vote, and a healed replica jumps to its
    peer's step, so the counter that ``max_steps``, checkpoint names and loggers key off is reset from the Manager.
    """
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready = committed_steps
    total.completed = committed_steps


def align_logger_step(trainer: pl.Trainer, committed_steps: int) -> None:
    """Log this batch's metrics at the committed step, as Lightning does with its own step count at batch start."""
    lightning_internals.set_batches_that_stepped(trainer, committed_steps)


def realign_after_the_first_commit(
    trainer: pl.Trainer, committed: bool | None, step: int, *, sharded: bool = False
) -> bool:
    """After the job's first commit (Manager ``step`` 1) in a group of several ranks, broadcast rank 0's state in the
    group (:func:`broadcast_state_in_group`: ``init_sync`` healed each rank from a possibly different group). Not with
    FSDP (``sharded``): each rank holds its own shard, and rank r of every group healed from the same group. Each step
    owner calls this as its step closes; returns whether it broadcast."""
    if not committed or step != 1 or trainer.world_size == 1 or sharded:
        return False
    broadcast_state_in_group(trainer)
    return True


def broadcast_state_in_group(trainer: pl.Trainer) -> None:
    """Overwrite the model and optimizer state of every group rank with group rank 0's, in place.

    Needed once, after the job's first committed step. With ``init_sync``, torchft chooses the step-0 heal source
    *per group rank* (rank r heals from the r-th up-to-date group), which suits sharded state but leaves the ranks
    of a data-parallel group holding different groups' initial weights. Rank 0 of every group ends step 1 with the
    same state, so copying it across each group makes every replica identical. Tensors go one by one in a fixed
    order (state-dict order, then each optimizer's parameter order), which every rank shares.
    """
    import torch.distributed as dist

    tensors = list(trainer.lightning_module.state_dict().values())
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors.extend(state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor))
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


def state_fingerprint(trainer: pl.Trainer) -> str:
    """SHA-256 over the exact bytes of the model and optimizer state: equal fingerprints mean bit-identical replicas.

    With FSDP it covers the full (unsharded) state, gathered on every rank (a collective inside the group), so every
    rank of every replica reports the same fingerprint.
    """
    digest = hashlib.sha256()
    module = trainer.lightning_module
    if holds_shards(trainer):
        _hash_tree(digest, "model", full_model_state(module, rank0_only=False))
        for index, optimizer in enumerate(trainer.optimizers):
            _hash_tree(digest, f"optimizer{index}", full_optimizer_state(module, optimizer, rank0_only=False))
        return digest.hexdigest()
    _hash_tree(digest, "model", module.state_dict())
    for index, optimizer in enumerate(trainer.optimizers):
        _hash_tree(digest, f"optimizer{index}", optimizer.state_dict())
    return digest.hexdigest()


def _hash_tree(digest: Any, prefix: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        digest.update(prefix.encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _hash_tree(digest, f"{prefix}.{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _hash_tree(digest, f"{prefix}[{index}]", item)
    else:
        digest.update(f"{prefix}={value!r}".encode())

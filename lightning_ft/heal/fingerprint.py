"""Fingerprints of the training state a heal carries, entry by entry, to prove that every group holds the same one.

The state is the one definition of :mod:`lightning_ft.heal.state`: Lightning's checkpoint of the replica, less what
each group keeps by design. Each entry (the model, the optimizers, the LR schedulers, the precision plugin, each
callback's state by ``state_key``, whatever a module, datamodule or callback adds in ``on_save_checkpoint``) gets an
exact fingerprint, so a mismatch names the entries that differ.

Tensors are read as 32-bit words (bytes when their size is not a multiple of 4), summed in 64-bit integer arithmetic
and their squares (wrapping at 32 bits) summed too, on their own device, each weighted by a number drawn from its
path in the state: the same bytes at the same place give the same result whatever the device, kernel or order, and
one flipped bit, or two tensors swapped, changes it. Other values (numbers, strings, ``None``) are hashed by their
text. With FSDP each rank fingerprints its own shards; rank r of every group holds the same shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, Timer
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_ft.heal.state import APPLIED_OWN_WAY, capture_training_state

_MASK = (1 << 64) - 1

#: Callbacks whose checkpoint state is each group's own, and why: they are left out of the comparison.
PER_GROUP_CALLBACKS: dict[type[pl.Callback], str] = {
    Checkpoint: "each group's own files: its best and last paths, in its own folder",
    Timer: "each group's own clock (the time limit itself is part of the job's contract)",
}


def state_fingerprints(trainer: pl.Trainer, synced_buffers: set[str] | None) -> dict[str, list[int]]:
    """``{entry: [sum, sum of squares]}`` over the state a heal carries (see the module's docstring).

    Args:
        synced_buffers: The model's buffers that the job keeps identical (``buffer_sync="average"``), by name;
            the others differ between groups by design and are left out. ``None``: every buffer.
    """
    state = capture_training_state(trainer)
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
    per_group = {callback.state_key for callback in callbacks if isinstance(callback, tuple(PER_GROUP_CALLBACKS))}
    entries: dict[str, Any] = {}
    for key, value in state.items():
        if key in APPLIED_OWN_WAY:
            continue
        if key == "callbacks":
            entries.update({f"callbacks[{name}]": part for name, part in value.items() if name not in per_group})
        elif key == "state_dict" and synced_buffers is not None:
            buffers = {name for name, _ in trainer.lightning_module.named_buffers()} - synced_buffers
            entries[key] = {name: tensor for name, tensor in value.items() if name not in buffers}
        else:
            entries[key] = value
    names = sorted(entries)
    parts = [_tree_sums(entries[name]) for name in names]
    # One read per device for the whole state (on a GPU, one host sync), not one per entry.
    read = {
        device: torch.stack([sums.get(device, torch.zeros(2, dtype=torch.int64, device=device)) for _, sums in parts])
        .cpu()
        .tolist()
        for device in {device for _, sums in parts for device in sums}
    }
    fingerprints = {}
    for index, (name, (total, _)) in enumerate(zip(names, parts, strict=True)):
        squares = 0
        for rows in read.values():
            total = (total + rows[index][0]) & _MASK
            squares = (squares + rows[index][1]) & _MASK
        fingerprints[name] = [total, squares]
    return fingerprints


def _tree_sums(value: Any) -> tuple[int, dict[torch.device, Tensor]]:
    """A nested state's (dicts, lists, tensors, plain values) text hash, and its tensors' weighted ``[sum, sum of
    squares]`` on each device they live on, not yet read; see the module."""
    total = 0
    on_device: dict[torch.device, Tensor] = {}
    for path, leaf in _leaves("", value):
        weight = _path_weight(path)
        if isinstance(leaf, Tensor):
            sums = torch.stack(_words_fingerprint(leaf)) * weight
            on_device[sums.device] = on_device[sums.device] + sums if sums.device in on_device else sums
        else:
            total = (total + weight * _text_hash(path, leaf)) & _MASK
    return total, on_device


def _words_fingerprint(tensor: Tensor) -> tuple[Tensor, Tensor]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    data = local.detach().contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.view(torch.uint8)
    words = data.view(torch.int32) if data.numel() * data.element_size() % 4 == 0 else data.view(torch.uint8).int()
    # Squares wrap in 32 bits and sums in 64: exact and order-independent either way, at half the memory traffic of
    # widening every word first.
    return words.sum(dtype=torch.int64), (words * words).sum(dtype=torch.int64)


def _leaves(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _leaves(f"{path}.{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(f"{path}[{index}]", item)
    else:
        yield path, value


def _path_weight(path: str) -> int:
    """An odd number from the path, below 2**31: products with 64-bit sums wrap, and stay exact."""
    return (int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "little") & 0x7FFFFFFF) | 1


def _text_hash(path: str, value: Any) -> int:
    text = repr(value)
    if " at 0x" in text:  # an object's default repr names its address, which differs in every process
        text = type(value).__qualname__
    return int.from_bytes(hashlib.sha256(f"{path}={text}".encode()).digest()[:8], "little")

"""What the strategy's checkpoint methods hand over while a heal builds or restores Lightning's checkpoint.

A heal is Lightning's checkpoint, built and restored by Lightning's own code (:mod:`lightning_ft.heal.state`). That
code asks the strategy for the model's and each optimizer's state, and hands them back to it. For a checkpoint file
FTStrategy gives the group's full state (with FSDP, gathered for group rank 0, a collective inside the group). A heal
needs another answer: the sender's rank r serves the healer's rank r, on one process, so it must hand this process's
own state, with no collective, and the buffers as the group last committed them (the forward pass may be changing
the live ones while the state is sent, :mod:`lightning_ft.step.buffers`). While a :class:`HealCheckpointMode` is
open, FTStrategy's four checkpoint methods give and take exactly that.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ft.hsdp.shards import to_local_shards


class HealCheckpointMode:
    """Open (:meth:`open`) while a heal builds or restores Lightning's checkpoint, for the thread that opened it.

    Per thread, because the sender builds its checkpoint on torchft's quorum thread (with asynchronous quorum, while
    the training thread computes the step): a checkpoint file that the training thread saved meanwhile must still get
    the group's full state, and lightning-ft's own checkpoint hooks must still write theirs."""

    def __init__(self) -> None:
        self._thread = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        """Closed, whatever it was (a pickled strategy, or a pickled callback that holds it, is a copy at rest)."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._thread = threading.local()

    @property
    def is_open(self) -> bool:
        return bool(getattr(self._thread, "open", False))

    @contextmanager
    def open(self, sharded: bool, committed_buffers: Mapping[str, torch.Tensor] | None = None) -> Iterator[None]:
        """Serve this replica's own state until the block ends. ``sharded``: each rank holds a shard of the model
        (FSDP), which then travels as its local tensors; ``committed_buffers`` replace the live buffers."""
        state = self._thread
        state.open, state.sharded, state.committed_buffers = True, sharded, dict(committed_buffers or {})
        try:
            yield
        finally:
            state.open, state.sharded, state.committed_buffers = False, False, {}

    @property
    def _sharded(self) -> bool:
        return bool(getattr(self._thread, "sharded", False))

    @property
    def _committed_buffers(self) -> dict[str, torch.Tensor]:
        buffers: dict[str, torch.Tensor] = getattr(self._thread, "committed_buffers", {})
        return buffers

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The module's own ``state_dict()`` as a heal sends it: its buffers as committed, with FSDP its shards."""
        for name, tensor in self._committed_buffers.items():
            if name in state:  # persistent buffers only: the others are not part of the state
                state[name] = tensor
        return to_local_shards(state) if self._sharded else state

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer's own ``state_dict()`` as a heal sends it: with FSDP, of this rank's shards."""
        return to_local_shards(state) if self._sharded else state


def healing(trainer: pl.Trainer) -> bool:
    """Whether a heal is building or restoring the checkpoint right now: the checkpoint hooks of lightning-ft's own
    callbacks that keep per-group state, or state torchft's part of the payload carries, stand aside then."""
    mode = getattr(trainer.strategy, "heal_mode", None)
    return isinstance(mode, HealCheckpointMode) and mode.is_open

"""Each rank's own data position, saved beside every checkpoint.

A checkpoint file is written by one process only (see ``FTStrategy.is_checkpoint_writer``), so its
``StatefulDataLoader`` state is the writer's, which the file says (``checkpoint["lightning_ft"]["data_position_of"]``):
the position in *another* group's shard for everyone else. Every other rank of every group therefore writes a small
*sidecar* next to the checkpoint (a one-process job writes none: its folder holds what Lightning's holds)::

    <checkpoint>.data/group<G>.rank<R>.pt     e.g. checkpoints/last.ckpt.data/group1.rank0.pt

holding the checkpoint's ``global_step`` (to tell a sidecar that belongs to this very checkpoint from a stale one),
the loop position (epoch and batch progress, equal in every group) and, when the train dataloaders are stateful,
the rank's own ``CombinedLoader`` state. Each rank writes only its own file, crash-safely (temporary file, fsync,
rename), so groups never write the same file.

On resume, :func:`use_own_position` puts the rank's own loader state into the loaded checkpoint, where Lightning
restores it from. Without a usable sidecar (none, stale, unreadable), the writer's loader state is dropped, because
it belongs to another shard, and the group reaches its position by counting batches instead; an unreadable sidecar
is logged with its path and what to do, never fatal: counting is exact for the deterministic samplers Lightning
installs, and a group that stopped on it would leave its peers waiting.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_ft import lightning_internals
from lightning_ft.checkpoint_io import write_atomically

log = logging.getLogger("lightning.pytorch.lightning_ft")

SIDECAR_FORMAT = 1
SIDECAR_DIR_SUFFIX = ".data"
# The checkpoint's own entry for lightning-ft, and in it whose data position the checkpoint's loader state is.
CHECKPOINT_KEY = "lightning_ft"
POSITION_OF = "data_position_of"


def sidecar_dir(checkpoint_path: lightning_internals.PathLike) -> str:
    """``<checkpoint>.data``; a local symbolic link (``ModelCheckpoint(save_last="link")``) is followed, so the
    sidecars of ``last.ckpt`` are those of the checkpoint it points to."""
    path = str(checkpoint_path)
    if lightning_internals.is_local_file_protocol(path):
        path = os.path.realpath(path)
    return path + SIDECAR_DIR_SUFFIX


def sidecar_path(checkpoint_path: lightning_internals.PathLike, replica_group_id: int, group_rank: int) -> str:
    return f"{sidecar_dir(checkpoint_path)}/group{replica_group_id}.rank{group_rank}.pt"


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    return checkpoint.get("loops", {}).get("fit_loop")


def _position(checkpoint_epoch: Any, batch_progress: dict[str, Any]) -> tuple[Any, Any, Any]:
    return checkpoint_epoch, batch_progress["current"]["ready"], batch_progress["total"]["ready"]


def sidecar_for(checkpoint: dict[str, Any], replica_group_id: int, group_rank: int) -> dict[str, Any] | None:
    """This rank's sidecar for ``checkpoint`` (which every rank computes, with its own loops and loaders in it);
    None when the checkpoint holds no fit-loop state."""
    fit_loop = _fit_loop_state(checkpoint)
    if fit_loop is None:
        return None
    return {
        "format": SIDECAR_FORMAT,
        "global_step": checkpoint.get("global_step"),
        "replica_group_id": replica_group_id,
        "group_rank": group_rank,
        "epoch": checkpoint.get("epoch"),
        "batch_progress": fit_loop["epoch_loop.batch_progress"],
        "combined_loader": fit_loop.get("state_dict", {}).get("combined_loader"),
    }


def write_sidecar(sidecar: dict[str, Any], path: str) -> None:
    """Write one sidecar whole or not at all. Only this rank writes ``path``, so only its own leftovers from a
    write that was killed midway are swept (other ranks write into the same directory at the same time)."""
    if not lightning_internals.is_local_file_protocol(path):
        lightning_internals.atomic_save(sidecar, path)
        return
    target = Path(path)
    write_atomically(sidecar, target)
    for stale in target.parent.glob(f".{target.name}.*.partial"):
        stale.unlink(missing_ok=True)


def save_own_position(
    checkpoint: dict[str, Any],
    checkpoint_path: lightning_internals.PathLike,
    replica_group_id: int,
    group_rank: int,
    *,
    is_writer: bool = False,
) -> None:
    """Keep this rank's data position for the checkpoint being saved at ``checkpoint_path``: in the checkpoint itself
    for its writer (which says so in it), in a sidecar for every other rank."""
    if is_writer:
        checkpoint.setdefault(CHECKPOINT_KEY, {})[POSITION_OF] = [replica_group_id, group_rank]
        return
    sidecar = sidecar_for(checkpoint, replica_group_id, group_rank)
    if sidecar is not None:
        write_sidecar(sidecar, sidecar_path(checkpoint_path, replica_group_id, group_rank))


def remove_sidecars(checkpoint_path: lightning_internals.PathLike) -> None:
    """Remove every rank's sidecars of one checkpoint (and nothing else: other checkpoints' sidecars live in their
    own directories, possibly being written by other groups right now)."""
    directory = sidecar_dir(checkpoint_path)
    fs = get_filesystem(directory)
    if fs.exists(directory):
        fs.rm(directory, recursive=True)


def use_own_position(
    checkpoint: dict[str, Any],
    checkpoint_path: lightning_internals.PathLike,
    replica_group_id: int,
    group_rank: int,
    weights_only: bool | None = None,
) -> str:
    """Make the loaded ``checkpoint`` carry this rank's own loader state, or none. Returns how the position will be
    reached: ``"loader_state"`` (Lightning restores this rank's stateful loaders) or ``"counting"``."""
    fit_loop = _fit_loop_state(checkpoint)
    if fit_loop is None:
        return "counting"
    loop_state = fit_loop.setdefault("state_dict", {})
    if checkpoint.get(CHECKPOINT_KEY, {}).get(POSITION_OF) == [replica_group_id, group_rank]:
        return "loader_state" if loop_state.get("combined_loader") else "counting"  # this rank wrote it
    writers_loader_state = loop_state.pop("combined_loader", None)
    path = sidecar_path(checkpoint_path, replica_group_id, group_rank)
    sidecar, problem = _read_sidecar(path, weights_only)
    if sidecar is None:
        if problem is not None:
            log.warning(
                "lightning-ft: cannot use this group's data position %s (%s). This rank falls back to counting "
                "batches from the start of the epoch, which is exact unless its dataset or sampler keeps state of "
                "its own. Delete the file to silence this warning, or restore it from a copy.",
                path,
                problem,
            )
        elif writers_loader_state:
            log.info("lightning-ft: no data position saved for this rank at %s; counting batches instead", path)
        return "counting"
    mismatch = _mismatch(checkpoint, fit_loop, sidecar)
    if mismatch is not None:
        log.warning("lightning-ft: ignoring %s: %s; counting batches instead", path, mismatch)
        return "counting"
    if sidecar.get("combined_loader"):
        loop_state["combined_loader"] = sidecar["combined_loader"]
        return "loader_state"
    return "counting"


def _read_sidecar(path: str, weights_only: bool | None) -> tuple[dict[str, Any] | None, str | None]:
    """(sidecar, None), (None, None) when there is none, or (None, what is wrong with it)."""
    if not get_filesystem(path).exists(path):
        return None, None
    try:
        # A sidecar is plain data written by lightning-ft, so it loads with weights_only=True unless the caller
        # explicitly allowed more (a StatefulDataLoader state may hold the user's own dataset state).
        sidecar = lightning_internals.load_file(
            path, map_location="cpu", weights_only=True if weights_only is None else weights_only
        )
    except Exception as error:  # any unreadable content: truncated, not a torch file, unpicklable
        return None, f"unreadable: {type(error).__name__}: {error}"
    if not isinstance(sidecar, dict) or sidecar.get("format") != SIDECAR_FORMAT or "batch_progress" not in sidecar:
        return None, "not a lightning-ft data position file of this version"
    return sidecar, None


def _mismatch(checkpoint: dict[str, Any], fit_loop: dict[str, Any], sidecar: dict[str, Any]) -> str | None:
    if sidecar.get("global_step") != checkpoint.get("global_step"):
        return (
            f"it was saved at step {sidecar.get('global_step')}, the checkpoint at step {checkpoint.get('global_step')}"
        )
    ours = _position(sidecar.get("epoch"), sidecar["batch_progress"])
    shared = _position(checkpoint.get("epoch"), fit_loop["epoch_loop.batch_progress"])
    if ours != shared:
        return f"it was saved at (epoch, batch, total batches) {ours}, the checkpoint at {shared}"
    return None

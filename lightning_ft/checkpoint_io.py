"""Checkpoint files that are written whole or not at all, even when the writer is SIGKILLed mid-write.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in the system
temp directory; committing it is a ``shutil.move``, which is a copy whenever that directory is on another
filesystem, so a writer killed during the copy leaves a truncated checkpoint behind. Fault-tolerant jobs are killed
by design, so local checkpoints are written to a temporary file *in the same directory*, flushed to disk, and
renamed over the target (``os.replace`` is atomic on POSIX); the next write sweeps away what a killed writer left.
Remote paths keep Lightning's behaviour.

Loading is the other half. A checkpoint that cannot be read (cut short by a copy, overwritten by something else,
not a checkpoint at all) makes ``torch.load`` fail deep inside its zip or pickle reader, with a message that does
not name the file; :func:`unreadable_checkpoint` turns that into an error that names the path and what to do.
Checkpoints are loaded with ``weights_only=True`` unless the caller explicitly asks otherwise: everything
lightning-ft writes into them is plain data (tensors, numbers, strings, containers), and a file that holds other
objects is refused instead of running their pickled code.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_ft import lightning_internals
from lightning_ft.errors import LightningFTError


def write_atomically(obj: Any, target: Path) -> None:
    """``torch.save`` ``obj`` to the local file ``target`` whole or not at all: a temporary file in the same
    directory (named ``.<target name>.*.partial``), flushed to disk, then renamed over ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class UnreadableCheckpointError(LightningFTError, RuntimeError):
    """A checkpoint file that cannot be loaded. The message names the file, what is wrong and what to do."""


def _cause(error: BaseException, limit: int = 200) -> str:
    """The part of ``error`` that says what is wrong with the bytes. torch's weights-only unpickler wraps that in
    advice to retry with ``weights_only=False``, which is wrong for a damaged file, so only its detail is kept."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    marker = "WeightsUnpickler error:"
    for index, line in enumerate(lines):
        if marker in line:
            detail = line.split(marker, 1)[1].strip() or (lines[index + 1] if index + 1 < len(lines) else "")
            lines = [detail]
            break
    text = lines[0] if lines else "(no message)"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def refused_global(error: BaseException) -> str | None:
    """The line of torch's weights-only refusal that names the object, if ``error`` is one. A corrupt file fails in
    the same unpickler with other messages ("Unsupported operand"), so only a named global counts."""
    if not isinstance(error, pickle.UnpicklingError):
        return None
    for line in str(error).splitlines():
        if "GLOBAL" in line:
            named = line.split("WeightsUnpickler error:")[-1].split(" Please use")[0].strip()
            return named if named.endswith(".") else f"{named}."
    return None


def unreadable_checkpoint(path: lightning_internals.PathLike, error: Exception) -> UnreadableCheckpointError:
    """Explain why ``torch.load`` could not load the checkpoint at ``path``: it holds objects that a
    ``weights_only=True`` load refuses, or it is corrupt or truncated."""
    refused = refused_global(error)
    if refused is not None:
        return UnreadableCheckpointError(
            f"lightning-ft: checkpoint {path} holds a Python object that a safe load (weights_only=True) refuses: "
            f"{refused} Only if you trust this file: allow that type with torch.serialization.add_safe_globals, or "
            f"load it with Trainer.fit(..., weights_only=False)."
        )
    return UnreadableCheckpointError(
        f"lightning-ft: checkpoint {path} is corrupt or truncated and cannot be loaded ({_cause(error)}). "
        f"Resume from an older checkpoint (ckpt_path=...) or restore this file from a copy."
    )


def archive_damaged(path: lightning_internals.PathLike) -> bool | None:
    """Whether the bytes at ``path`` are not an intact ``torch.save`` archive (a zip file whose members all pass
    their CRC check): True when they are not, False when they are, None when this cannot be told here (a remote
    path, or torch's legacy non-zip format, which has no checksums)."""
    if not lightning_internals.is_local_file_protocol(path):
        return None
    try:
        with open(path, "rb") as file:
            head = file.read(2)
    except OSError:
        return None
    if head.startswith(b"\x80"):  # a bare pickle: the legacy format
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is not None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return True


def load_checked(path: lightning_internals.PathLike, load: Callable[[], Any]) -> dict[str, Any]:
    """Run ``load()`` (a ``torch.load`` of ``path``) and turn a failure to read the file into an
    :class:`UnreadableCheckpointError`. A missing file or a denied access passes unchanged: those messages name the
    path already."""
    try:
        checkpoint = load()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    # The zip reader, the unpickler, or torch's rebuild of a cut-off tensor; a seek past the end of a truncated
    # file is an OSError (EINVAL) too. Only an error whose cause was checked is explained: a refused object, or bytes
    # that are not an intact archive. Anything else (a loader called with an argument it does not take, a full
    # disk while mapping) passes with its own message.
    except Exception as error:
        if refused_global(error) is not None or archive_damaged(path):
            raise unreadable_checkpoint(path, error) from error
        raise
    if not isinstance(checkpoint, dict):
        raise UnreadableCheckpointError(
            f"lightning-ft: {path} is not a Lightning checkpoint: it holds a {type(checkpoint).__name__}, not a dict. "
            f"Pass the path of a .ckpt file written by Trainer.save_checkpoint or ModelCheckpoint."
        )
    return checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local writes (temporary file, fsync, atomic rename)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: lightning_internals.PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not lightning_internals.is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(path)
        write_atomically(checkpoint, target)
        self._remove_stale_partials(target.parent)

    @staticmethod
    def _remove_stale_partials(directory: Path) -> None:
        """Remove temporary files that a writer killed mid-write left behind.

        Only one process writes checkpoints at a time (see ``FTStrategy.is_checkpoint_writer``), so once this
        write is done, any other temporary file in the directory belongs to a writer that is gone.
        """
        for stale in directory.glob(".*.partial"):
            stale.unlink(missing_ok=True)

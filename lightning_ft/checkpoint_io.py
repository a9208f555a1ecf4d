"""Checkpoint files that are written whole or not at all, even when the writer is SIGKILLed mid-write.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in the system
temp directory; committing it is a ``shutil.move``, which is a copy whenever that directory is on another
filesystem, so a writer killed during the copy leaves a truncated checkpoint behind. Fault-tolerant jobs are killed
by design, so local checkpoints are written to a temporary file *in the same directory*, flushed to disk, and
renamed over the target (``os.replace`` is atomic on POSIX); the next write sweeps away what a killed writer left.
Remote paths keep Lightning's behaviour.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override


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


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local writes (temporary file, fsync, atomic rename)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
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

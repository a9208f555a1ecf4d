"""``AtomicCheckpointIO`` and ``load_checked`` (lightning_ft/checkpoint_io.py), called directly on local files.

Why: fault-tolerant jobs are killed by design, often while the checkpoint writer is mid-write. A checkpoint must
therefore appear under its final name whole or not at all: the bytes go to a temporary file in the same directory
(same filesystem, so the rename is atomic), are flushed to disk, and only then renamed over the target. A write that
dies leaves the previous checkpoint as it was, and what a killed writer left behind is swept by the next write.
Remote paths and ``storage_options`` keep Lightning's own behaviour. A file that cannot be read must fail with an
error that names it, not deep inside torch's zip or pickle reader.

A crash mid-write is simulated by a ``torch.save`` that writes part of the file and then raises.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pytest
import torch

from lightning_ft.checkpoint_io import AtomicCheckpointIO, UnreadableCheckpointError, load_checked

pytestmark = pytest.mark.timeout(60)

REAL_SAVE = torch.save


def checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {"weight": torch.full((4, 4), value)}, "global_step": int(value), "epoch": 0}


def load(path: Path) -> dict[str, Any]:
    return AtomicCheckpointIO().load_checkpoint(path, weights_only=True)


def partials(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.partial"))


def test_a_save_round_trips_creates_its_directory_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    loaded = load(path)
    assert loaded["global_step"] == 1 and torch.equal(loaded["state_dict"]["weight"], torch.full((4, 4), 1.0))
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("existing", [False, True], ids=["first-save", "overwrite"])
def test_the_final_name_never_holds_a_partly_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """Right after torch.save has written every byte, but before the write is committed, the final name holds
    nothing (first save) or the previous checkpoint, and the bytes sit in a hidden temporary file next to it."""
    path = tmp_path / "last.ckpt"
    if existing:
        AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    previous = path.read_bytes() if existing else None
    seen: list[tuple[bytes | None, list[Path]]] = []

    def observing_save(obj: Any, file: BinaryIO, *args: Any, **kwargs: Any) -> None:
        REAL_SAVE(obj, file, *args, **kwargs)
        seen.append((path.read_bytes() if path.exists() else None, partials(tmp_path)))

    monkeypatch.setattr(torch, "save", observing_save)
    AtomicCheckpointIO().save_checkpoint(checkpoint(2.0), path)
    [(under_final_name, temporary)] = seen
    assert under_final_name == previous, "the final name changed before the write was complete"
    assert len(temporary) == 1 and temporary[0].name.startswith(".last.ckpt."), temporary
    assert load(path)["global_step"] == 2
    assert partials(tmp_path) == []


def test_the_bytes_are_flushed_to_disk_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an fsync before the rename, a machine crash can leave the new name pointing at unwritten blocks."""
    calls: list[tuple[str, Any]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        calls.append(("fsync", fd))
        fsync(fd)

    def recording_replace(source: Any, target: Any) -> None:
        calls.append(("replace", Path(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    assert [name for name, _ in calls] == ["fsync", "replace"], calls
    assert calls[-1] == ("replace", path)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=type)
def test_a_write_that_dies_midway_leaves_the_previous_checkpoint_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """Any exception (a full disk, or a KeyboardInterrupt/SystemExit that is not an ``Exception``) propagates, and
    leaves the directory as it was before the write."""
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    before = path.read_bytes()

    def dying_save(obj: Any, file: BinaryIO, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")
        raise error

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(type(error)):
        AtomicCheckpointIO().save_checkpoint(checkpoint(2.0), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    monkeypatch.undo()
    assert load(path)["global_step"] == 1


def test_a_first_write_that_dies_leaves_nothing_under_the_final_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dying_save(obj: Any, file: BinaryIO, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")
        raise RuntimeError("killed")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(RuntimeError, match="killed"):
        AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), tmp_path / "last.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_the_next_save_sweeps_what_a_killed_writer_left_and_nothing_else(tmp_path: Path) -> None:
    """A SIGKILLed writer cannot clean up; its temporary files (hidden, ``.partial``) go with the next write."""
    left_behind = [tmp_path / ".last.ckpt.k1l2d.partial", tmp_path / ".epoch=0-step=4.ckpt.x9.partial"]
    kept = [tmp_path / "epoch=0-step=4.ckpt", tmp_path / "notes.partial", tmp_path / ".hidden"]
    for file in left_behind + kept:
        file.write_bytes(b"x")
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), tmp_path / "last.ckpt")
    assert partials(tmp_path) == []
    assert all(file.read_bytes() == b"x" for file in kept)
    assert load(tmp_path / "last.ckpt")["global_step"] == 1


def test_remove_checkpoint_deletes_the_file_and_ignores_a_missing_one(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "epoch=0-step=4.ckpt"
    other = tmp_path / "last.ckpt"
    io.save_checkpoint(checkpoint(1.0), path)
    io.save_checkpoint(checkpoint(2.0), other)
    io.remove_checkpoint(path)
    assert not path.exists() and other.exists()
    io.remove_checkpoint(path)  # already gone: no error


@pytest.fixture
def memory_filesystem() -> Iterator[fsspec.AbstractFileSystem]:
    filesystem = fsspec.filesystem("memory")
    yield filesystem
    if filesystem.exists("/lightning-ft-test"):
        filesystem.rm("/lightning-ft-test", recursive=True)


def test_a_remote_path_goes_through_lightnings_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_filesystem: fsspec.AbstractFileSystem
) -> None:
    """A non-local URL is not a local path: nothing may be created on local disk for it (the working directory here)."""
    monkeypatch.chdir(tmp_path)
    url = "memory://lightning-ft-test/checkpoints/last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(3.0), url)
    assert memory_filesystem.exists("/lightning-ft-test/checkpoints/last.ckpt")
    assert AtomicCheckpointIO().load_checkpoint(url, weights_only=True)["global_step"] == 3
    assert list(tmp_path.iterdir()) == []


def test_storage_options_are_left_to_lightning_which_refuses_them(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path, storage_options={"compression": "zip"})
    assert not path.exists()


# ---------------------------------------------------------------------------------------------- reading back
def loader(path: Path) -> Callable[[], Any]:
    return functools.partial(AtomicCheckpointIO().load_checkpoint, path, weights_only=True)


@pytest.mark.parametrize("cut", [0.5, 0.0], ids=["cut-in-half", "empty"])
def test_a_truncated_checkpoint_is_named_in_the_error(tmp_path: Path, cut: float) -> None:
    """What a non-atomic writer killed mid-copy leaves: the error names the file and what to do, and keeps torch's
    error as its cause."""
    whole = tmp_path / "whole.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), whole)
    data = whole.read_bytes()
    path = tmp_path / "last.ckpt"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(UnreadableCheckpointError) as unreadable:
        load_checked(path, loader(path))
    message = str(unreadable.value)
    assert str(path) in message and "is corrupt or truncated" in message, message
    assert "Resume from an older checkpoint" in message
    assert unreadable.value.__cause__ is not None


def test_a_missing_checkpoint_raises_the_loaders_own_error(tmp_path: Path) -> None:
    path = tmp_path / "missing.ckpt"
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt"):
        load_checked(path, loader(path))


def test_a_file_that_is_not_a_dict_is_not_a_lightning_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    REAL_SAVE([torch.zeros(2)], path)
    with pytest.raises(UnreadableCheckpointError, match=r"is not a Lightning checkpoint: it holds a list"):
        load_checked(path, loader(path))


class Custom:
    """An object a ``weights_only=True`` load refuses."""


def test_a_checkpoint_holding_an_object_a_safe_load_refuses_says_so(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    REAL_SAVE({"state_dict": {}, "extra": Custom()}, path)
    with pytest.raises(UnreadableCheckpointError) as refused:
        load_checked(path, loader(path))
    message = str(refused.value)
    assert str(path) in message and "weights_only=True" in message and "Custom" in message, message
    assert "Only if you trust this file" in message

"""Loading checkpoints and healed state: ``weights_only=True`` wherever lightning-ft loads, and a clear error naming
the file for a checkpoint that is corrupt, truncated, or holds objects a safe load refuses.

One real single-group run (embedded lighthouse, real Manager) writes the checkpoint and captures the heal payload
its Manager would serve to a peer; every test below loads one of those, or a damaged or malicious copy.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer as make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torchft.manager import ExceptionWithTraceback

from lightning_ft import FTStrategy
from lightning_ft.checkpoint_io import (
    UnreadableCheckpointError,
    archive_damaged,
    load_checked,
)
from lightning_ft.data.sidecars import sidecar_path, use_own_position
from lightning_ft.manager import FTManager
from lightning_ft.manager.http_transport import CheckpointHTTPTransport, RefusedPeerStateError

pytestmark = pytest.mark.timeout(120)


def plant(marker: str) -> None:
    """What the malicious object runs when it is unpickled: proof that its code ran."""
    Path(marker).touch()


class Malicious:
    """Unpickling this calls :func:`plant`, as a crafted checkpoint would call anything else."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return plant, (self.marker,)


class WithHyperparameters(BoringModel):
    """BoringModel plus saved hyperparameters, which land in the checkpoint as well."""

    def __init__(self, width: int = 32, name: str = "boring") -> None:
        super().__init__()
        self.save_hyperparameters()


class CapturePayload(pl.Callback):
    """Keeps what this group's Manager would serve to a healing peer (torchft's own part and lightning-ft's)."""

    payload: dict[str, Any] | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.payload = trainer.strategy.manager._manager_state_dict()


@dataclass
class Written:
    last: Path
    payload: dict[str, Any]


def fit(root: Path, max_steps: int, ckpt_path: Path | None = None, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", True)
    trainer = make_trainer(FTStrategy(), max_steps=max_steps, default_root_dir=root, **kwargs)
    trainer.fit(WithHyperparameters(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    root = tmp_path_factory.mktemp("written")
    capture = CapturePayload()
    saved = dict(os.environ)
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        os.environ.pop(name, None)
    try:
        fit(root, 3, callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_last=True), capture])
    finally:  # the module fixture outlives the per-test environment restore in conftest
        os.environ.clear()
        os.environ.update(saved)
    assert capture.payload is not None
    return Written(last=root / "checkpoints" / "last.ckpt", payload=capture.payload)


@pytest.fixture(autouse=True)
def _single_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------- weights_only=True
def test_a_checkpoint_written_by_lightning_ft_loads_with_weights_only(written):
    checkpoint = torch.load(written.last, weights_only=True)
    assert checkpoint["global_step"] == 3
    assert checkpoint["hyper_parameters"] == {"width": 32, "name": "boring"}
    assert checkpoint["callbacks"]["ManagerCheckpointCallback"]["manager"]["step"] == 3
    assert checkpoint["lightning_ft"] == {"data_position_of": [0, 0]}  # the writer's own position is in the file


def test_resuming_loads_the_checkpoint_with_weights_only(written, tmp_path, monkeypatch):
    """FTStrategy passes weights_only=True to torch.load when the caller did not choose, whatever torch's default."""
    calls: list[Any] = []
    load = torch.load

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    trainer = fit(tmp_path, 4, ckpt_path=written.last, enable_checkpointing=False)
    assert trainer.global_step == 4
    assert calls and all(weights_only is True for weights_only in calls), calls


def test_a_checkpoint_with_a_malicious_object_is_refused_and_never_runs(written, tmp_path):
    marker = tmp_path / "planted"
    checkpoint = torch.load(written.last, weights_only=True)
    checkpoint["callbacks"]["Innocent"] = {"payload": Malicious(marker)}
    malicious = tmp_path / "malicious.ckpt"
    torch.save(checkpoint, malicious)
    with pytest.raises(UnreadableCheckpointError) as refused:
        fit(tmp_path, 4, ckpt_path=malicious, enable_checkpointing=False)
    message = str(refused.value)
    assert str(malicious) in message and "weights_only=True" in message and "plant" in message, message
    assert "Only if you trust this file" in message
    assert not marker.exists(), "the malicious object's code ran"
    torch.load(malicious, weights_only=False)  # the object is live: an unsafe load runs it
    assert marker.exists()


def test_a_sidecar_with_a_malicious_object_is_refused_and_never_runs(written, tmp_path, caplog):
    marker = tmp_path / "planted"
    checkpoint_path = tmp_path / "last.ckpt"
    sidecar = Path(sidecar_path(checkpoint_path, 1, 0))
    sidecar.parent.mkdir()
    torch.save({"format": 1, "batch_progress": Malicious(marker)}, sidecar)
    checkpoint = torch.load(written.last, weights_only=True)
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch.lightning_ft"):
        assert use_own_position(checkpoint, checkpoint_path, replica_group_id=1, group_rank=0) == "counting"
    assert str(sidecar) in caplog.text and "unreadable" in caplog.text
    assert not marker.exists(), "the malicious object's code ran"


# ---------------------------------------------------------------------------------------------- the heal payload
def transfer(payload: dict[str, Any]) -> Any:
    """Serve ``payload`` as a live peer's Manager does, and fetch it as a healing one does: real HTTP on loopback."""
    timeout = timedelta(seconds=30)
    transport = CheckpointHTTPTransport("127.0.0.1", timeout=timeout)
    try:
        transport.send_checkpoint(dst_ranks=[1], step=3, state_dict=payload, timeout=timeout)
        return transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=3, timeout=timeout)
    finally:
        transport.shutdown(wait=True)


def test_the_heal_payload_arrives_through_a_weights_only_load(written):
    received = transfer(written.payload)
    assert received["torchft"] == {"step": 3, "batches_committed": 3}
    model = received["user"]["lightning"]["state_dict"]
    for name, tensor in written.payload["user"]["lightning"]["state_dict"].items():
        assert torch.equal(model[name], tensor), name


def test_a_heal_payload_with_a_malicious_object_is_refused_and_never_runs(written, tmp_path):
    marker = tmp_path / "planted"
    payload = {**written.payload, "user": {**written.payload["user"], "evil": Malicious(marker)}}
    with pytest.raises(RefusedPeerStateError, match=r"weights_only=True\) refuses: .*plant"):
        transfer(payload)
    assert not marker.exists(), "the malicious object's code ran"


def test_a_refused_heal_stops_the_group_instead_of_retrying_forever():
    """torchft records a failed fetch and retries it at the next quorum; a refusal would fail the same way every
    time, so the Manager raises it at the commit vote (white box: torchft 0.2.0's heal state, set by hand)."""
    manager = object.__new__(FTManager)
    refusal = RefusedPeerStateError("lightning-ft: the live peer's training state ... refuses ...")
    manager._healing, manager._pending_state_dict, manager._heal_checks = True, None, {}
    manager._errored = ExceptionWithTraceback(refusal)
    with pytest.raises(RefusedPeerStateError) as raised:
        manager._vet_heal()
    assert raised.value is refusal


# ---------------------------------------------------------------------------------------------- corrupt files
def damaged(written: Written, directory: Path, kind: str) -> Path:
    data = written.last.read_bytes()
    contents = {
        "truncated": data[: len(data) // 2],
        "truncated-tail": data[:-64],
        # Fixed bytes, not os.urandom: random bytes that begin with 0x80 read as torch's legacy (bare pickle) format,
        # which has no checksum to tell a damaged file by (1 run in 256 failed that way).
        "garbage": random.Random(0).randbytes(4096),
        "empty": b"",
        "text": b"this is not a checkpoint\n",
    }
    path = directory / f"{kind}.ckpt"
    path.write_bytes(contents[kind])
    return path


@pytest.mark.parametrize("kind", ["truncated", "truncated-tail", "garbage", "empty", "text"])
def test_a_corrupt_checkpoint_names_the_file_and_what_to_do(written, tmp_path, kind):
    path = damaged(written, tmp_path, kind)
    with pytest.raises(UnreadableCheckpointError) as unreadable:
        fit(tmp_path, 4, ckpt_path=path, enable_checkpointing=False)
    message = str(unreadable.value)
    assert str(path) in message and "is corrupt or truncated" in message, message
    assert "Resume from an older checkpoint" in message


def test_a_legacy_format_file_that_fails_to_load_is_not_called_corrupt(written, tmp_path):
    """Bytes that begin like torch's legacy format (a bare pickle) have no checksum: lightning-ft cannot tell that
    they are damaged, so the loader's own error passes unchanged rather than a cause that was not checked."""
    path = tmp_path / "legacy.ckpt"
    path.write_bytes(b"\x80" + random.Random(1).randbytes(4095))
    with pytest.raises(Exception) as raised:
        fit(tmp_path, 4, ckpt_path=path, enable_checkpointing=False)
    assert not isinstance(raised.value, UnreadableCheckpointError), raised.value
    assert "corrupt" not in str(raised.value)


def test_a_torch_file_that_is_not_a_checkpoint_is_named(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(UnreadableCheckpointError, match=rf"{path} is not a Lightning checkpoint: it holds a list"):
        fit(tmp_path, 4, ckpt_path=path, enable_checkpointing=False)


def test_an_error_that_is_not_in_the_bytes_is_not_called_corruption(written):
    """An intact checkpoint whose loader fails for another reason (Lightning 2.5's loader, which takes no
    ``weights_only``) gets that error, with its own message: the file is not called corrupt."""

    def old_loader(path, map_location=None):  # Lightning 2.5's signature: no weights_only
        raise AssertionError("not called")

    def failing() -> dict:
        return old_loader(written.last, weights_only=True)  # type: ignore[call-arg]

    with pytest.raises(TypeError, match="weights_only"):
        load_checked(written.last, failing)
    assert archive_damaged(written.last) is False

"""Bad input fails fast with an error that names the setting and the fix (more cases: test_settings.py,
test_semi_sync_settings.py, test_state.py for incompatible replicas, test_data_position.py for corrupt sidecars)."""

from __future__ import annotations

import socket

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ft import FTStrategy


def _closed_port() -> int:
    """A loopback port with nothing listening (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_an_unreachable_lighthouse_is_reported_within_connect_timeout(tmp_path, monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    url = f"http://127.0.0.1:{_closed_port()}"
    trainer = pl.Trainer(
        strategy=FTStrategy(lighthouse=url, connect_timeout=3, quorum_timeout=5, timeout=5),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(RuntimeError, match=rf"{url}.*connect_timeout"):
        trainer.fit(BoringModel())

"""Helpers shared by the unit tests and the real-process tests: a small Lightning model and Trainer, bit-exact
comparison of states, a fake clock, and what /proc says about a process."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]


class Regressor(pl.LightningModule):
    def __init__(self, scheduler: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.with_scheduler = scheduler

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        if not self.with_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(n: int = 512, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size)


#: The GPU tests' mark: skipped where no CUDA device is (CI runs on CPU; the device checks run them).
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def keep_gpu_busy(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for at least ``seconds`` (``torch.cuda._sleep`` spins clock
    cycles: at a clock of 2 GHz or less, 2e9 of them a second take at least as long)."""
    torch.cuda._sleep(int(seconds * 2e9))


def trainer(strategy: Any = "ft", callbacks: list[pl.Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(strategy=strategy, callbacks=callbacks or [], **{**defaults, **kwargs})


def assert_tree_equal(a: Any, b: Any, where: str = "state") -> None:
    """Nested dicts/lists of tensors and plain values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ at {where}: {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_tree_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"length differs at {where}"
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"value differs at {where}: {a!r} vs {b!r}"


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between the open and the read
        return True
    return "State:\tZ" in status


def describe_process(pid: int) -> str:
    """One line on a live process for a failure message: its state, parent, kernel wait channel and command."""
    try:
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
        )
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return f"{pid}: gone"
    return (
        f"{pid}: state {status.get('State', '?')}, parent {status.get('PPid', '?')}, waits in {wchan}: {command}\n"
        f"  threads: {', '.join(_thread_states(pid))}"
    )


def _thread_states(pid: int) -> list[str]:
    """Each thread of ``pid`` as ``name(tid) state wait-channel``: which one runs, when a process does not end."""
    states = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda path: int(path.name)):
        try:
            stat = (task / "stat").read_text()
            state = stat[stat.rindex(")") + 2 :].split()[0]
            states.append(f"{(task / 'comm').read_text().strip()}({task.name}) {state} {(task / 'wchan').read_text()}")
        except (OSError, ValueError):  # ended meanwhile
            continue
    return states


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket that process ``pid`` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            # The kernel prints each 32-bit word of the address in host (little-endian) byte order.
            raw = b"".join(bytes.fromhex(address_hex[i : i + 8])[::-1] for i in range(0, len(address_hex), 8))
            found.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


class FakeClock:
    """Monotonic time that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def example_cli(monkeypatch: Any, config: str) -> Any:
    """``examples/train.py``'s LightningCLI built (not run) from ``examples/configs/<config>``, on one CPU process."""
    import sys

    from lightning.pytorch.cli import LightningCLI

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import train

    monkeypatch.setattr(sys, "argv", ["train.py", f"--config={REPO / 'examples' / 'configs' / config}"])
    return LightningCLI(
        train.RegressionModel,
        train.SyntheticData,
        run=False,
        trainer_defaults={"accelerator": "cpu", "devices": 1},
        save_config_callback=None,
    )

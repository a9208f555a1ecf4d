"""Helpers the benchmark drivers share: run a job with a deadline, stop it by PID, medians, the machine."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
LIGHTNING_FT = [sys.executable, "-m", "lightning_ft_cli"]


def bench_env(**extra: str) -> dict[str, str]:
    """One compute thread per process in every mode (torchrun sets it only with several processes per node), gloo
    restarts that reconnect (pytorch issue 135712), quiet torchft."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", RUST_LOG="warn", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_job(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run ``command`` in its own session with output to ``log``; on timeout, kill that session (ours alone)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=BENCH, env=env or bench_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"{' '.join(command)} ran past {timeout:.0f}s; see {log}") from None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def new_results_file(out: Path | None, stem: str) -> Path:
    """``out``, or ``results/<stem>_<UTC time>.json``; refuses a file that exists. Every run is kept (report.py gives
    each verdict over all of them), so no run replaces an earlier one's file."""
    path = out or RESULTS / f"{stem}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    if path.exists():
        raise SystemExit(f"{path} exists: every run is kept, choose a new --out")
    return path


def run_together(commands: list[tuple[list[str], Path]], limit: float) -> None:
    """Start every ``(command, log)`` at once, each in its own session with output to its log, and wait for all;
    raise as soon as one fails or ``limit`` seconds pass. Whatever happens, any left running is killed (ours alone)."""
    processes: list[tuple[subprocess.Popen[bytes], Path]] = []
    with contextlib.ExitStack() as files:
        try:
            for command, log in commands:
                out = files.enter_context(log.open("wb"))
                process = subprocess.Popen(
                    command, env=bench_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
                processes.append((process, log))
            deadline = time.monotonic() + limit
            while any(process.poll() is None for process, _ in processes):
                for process, log in processes:
                    if process.poll() not in (None, 0):
                        raise RuntimeError(f"{log.stem} exited with {process.returncode}:\n{tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ran past {limit:.0f}s:\n{tail(processes[-1][1])}")
                time.sleep(0.1)
            for process, log in processes:
                if process.returncode != 0:
                    raise RuntimeError(f"{log.stem} exited with {process.returncode}:\n{tail(log)}")
        finally:
            for process, _ in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def raw_torchft_manager(replica_id: str, state_dict: Any, load_state_dict: Any) -> Any:
    """A raw torchft ``Manager`` for a group of one process, as torchft's README builds it (benchmark workers that run
    no lightning-ft code). torchft reads MASTER_ADDR/MASTER_PORT as a store *client*; with one process per group
    nothing hosts that store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), so the group hosts its own, as lightning-ft does.
    The store is kept on the Manager (``bench_store``) for as long as it lives."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=replica_id,
    )
    manager.bench_store = store
    return manager


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:

    import lightning
    import torch
    import torchft  # noqa: F401

    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchft": torchft_distribution(),
        "lightning": lightning.__version__,
        "kernel": platform.release(),
    }


def torchft_distribution() -> str:
    """The installed torchft's distribution and version: ``torchft`` releases, or the ``torchft-nightly`` builds."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchft", "torchft-nightly"):
        try:
            return version(name) if name == "torchft" else f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"

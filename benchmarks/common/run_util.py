"""Helpers the benchmark drivers share: the environment of the processes they start, running a job with a deadline
and stopping it by PID, medians. Where results go and the machine they record: ``results.py``.

Every driver is a module of the ``benchmarks`` package, run from the repository root with ``python -m`` (``python -m
benchmarks.overhead.overhead``), and imports what it shares from ``benchmarks.common``. The processes a driver starts
(workers under ``torchrun`` or ``lightning-ft launch``, its own children) get the repository root on ``PYTHONPATH``
from ``repo_env`` / ``bench_env``, so a worker started by its path imports ``benchmarks.common`` the same way. The
test harness is the one thing imported from outside the package: ``process_harness.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_ft_cli.group_environment import GROUP_THREADS

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
LIGHTNING_FT = [sys.executable, "-m", "lightning_ft_cli"]


def repo_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository root first on ``PYTHONPATH``: a process started from it
    imports ``benchmarks.common`` (and the repository's own ``lightning_ft``) whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def module_command(module: str, *args: str) -> list[str]:
    """This interpreter running ``module`` (``python -m``): how a driver starts its own children. Start it with
    ``repo_env`` or ``bench_env``."""
    return [sys.executable, "-m", module, *args]


def bench_env(**extra: str) -> dict[str, str]:
    """``repo_env``, and in every mode the threads ``lightning-ft launch`` gives its groups (``GROUP_THREADS``: one
    compute thread per process, which torchrun sets only with several processes per node, and one tokio worker per
    torchft runtime, so that a raw torchft Manager under torchrun runs as lightning-ft's do), gloo restarts that
    reconnect (pytorch issue 135712), quiet torchft."""
    env = repo_env()
    env.update(GROUP_THREADS)
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", RUST_LOG="warn", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_job(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run ``command`` in its own session with output to ``log``; on timeout, kill that session (ours alone)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=env or bench_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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


def run_workers(commands: list[list[str]], what: str, timeout: float = 600) -> list[str]:
    """Start every command at once (a driver's own workers, with ``repo_env``), wait for all, and return each one's
    standard output; raise naming ``what`` if one fails. Whatever happens, any left running is killed (ours alone)."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, cwd=REPO, env=repo_env()) for command in commands]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(process.returncode for process in processes):
        raise RuntimeError(f"{what}: a worker failed ({[process.returncode for process in processes]})")
    return [output.decode() for output in outputs]


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


def raw_torchft_manager(replica_id: str, state_dict: Any, load_state_dict: Any, **options: Any) -> Any:
    """A raw torchft ``Manager`` for a group of one process, as torchft's README builds it (benchmark workers that run
    no lightning-ft code). torchft reads MASTER_ADDR/MASTER_PORT as a store *client*; with one process per group
    nothing hosts that store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), so the group hosts its own, as lightning-ft does.
    The store is kept on the Manager (``bench_store``) for as long as it lives. ``options``: more of the Manager's
    arguments."""
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
        **options,
    )
    manager.bench_store = store
    return manager


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")

"""The CPU seconds a whole job spends, every process of it: the launcher (and the lighthouse inside it), torchrun's
agents, the training processes, anything they start.

Wall time on 2 cores blurs what a process costs: a thread that runs beside training (torchft's quorum RPCs, the
lighthouse) takes its time from the same cores without showing in any one process's step time. So a driver runs a job
under :func:`run_job_sampling_cpu`, which reads the job's process tree (the job's root and every descendant, found
through each process's parent, whatever session it is in) from ``/proc`` every ``interval`` seconds, and keeps the
tree's cumulative CPU time (user + system) with the sample's ``time.monotonic()``. :func:`cpu_per_step` then divides
the CPU spent between two samples by the optimizer steps a training process ended between them (its step times are
``time.perf_counter()``, the same clock as ``time.monotonic()`` on Linux).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.run_util import REPO, bench_env

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds)`` of a live process, or ``None`` if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS  # ppid; utime + stime


def tree_cpu_seconds(root: int, seen: dict[int, float]) -> float:
    """The CPU seconds of ``root``'s tree so far: every live descendant read now, and every process seen before that
    has exited since at its last reading (``seen``, updated in place)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)], cpu[int(entry)] = stat
    inside = {root}
    changed = True
    while changed:  # a child's pid may be lower than its parent's: add descendants until nothing changes
        changed = False
        for pid, parent in parents.items():
            if parent in inside and pid not in inside:
                inside.add(pid)
                changed = True
    for pid in inside:
        if pid in cpu:
            seen[pid] = cpu[pid]
    return sum(seen.values())


def run_job_sampling_cpu(
    command: Sequence[str], log: Path, timeout: float, interval: float = 0.25
) -> tuple[int, list[tuple[float, float]]]:
    """Run ``command`` as ``run_util.run_job`` does (its own session, output to ``log``, killed by its session on a
    timeout: ours alone), sampling its tree's CPU. Returns the exit code and the samples ``(monotonic time, CPU
    seconds so far)``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(command), cwd=REPO, env=bench_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        seen: dict[int, float] = {}

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), tree_cpu_seconds(process.pid, seen)))
                stop.wait(interval)

        sampler = threading.Thread(target=sample, name="job-cpu", daemon=True)
        sampler.start()
        try:
            return process.wait(timeout=timeout), samples
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(command)} ran past {timeout:.0f}s; see {log}") from None
        finally:
            stop.set()
            sampler.join(timeout=5)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def cpu_per_step(samples: list[tuple[float, float]], step_ends: list[float], warmup: int) -> float | None:
    """The job's CPU seconds per optimizer step over its steady part: from the first sample after the ``warmup``-th
    step's end to the last sample before the last step's end, divided by the steps that ended in between. ``None``
    when fewer than two samples fall there."""
    if len(step_ends) <= warmup + 1:
        return None
    start, end = step_ends[warmup], step_ends[-1]
    inside = [(t, cpu) for t, cpu in samples if start <= t <= end]
    if len(inside) < 2:
        return None
    (t0, cpu0), (t1, cpu1) = inside[0], inside[-1]
    steps = sum(1 for t in step_ends if t0 < t <= t1)
    return (cpu1 - cpu0) / steps if steps else None

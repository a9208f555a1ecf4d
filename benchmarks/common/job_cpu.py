"""The CPU seconds a whole job spends, every process of it: the launcher (and the lighthouse inside it), torchrun's
agents, the training processes, anything they start.

Wall time on 2 cores blurs what a process costs: a thread that runs beside training (torchft's quorum RPCs, the
lighthouse) takes its time from the same cores without showing in any one process's step time. So a driver runs a job
under :func:`run_job_sampling_cpu`, which reads the job's process tree (the job's root and every descendant, found
through each process's parent, whatever session it is in) from ``/proc`` every ``interval`` seconds, and keeps the
tree's cumulative CPU time (user + system) with the sample's ``time.monotonic()``. :func:`cpu_per_step` then divides
the CPU spent between two samples by the optimizer steps a training process ended between them (its step times are
``time.perf_counter()``, the same clock as ``time.monotonic()`` on Linux).

Each sample also splits the job's CPU by kind of thread (:data:`THREAD_KINDS`), read from every thread's own
``/proc/<pid>/task/<tid>/stat``: whether a tax sits on the training threads or on the threads beside them
(torchft's quorum and Manager server, the lighthouse, Gloo's). A thread that ended keeps its last reading, so the
kinds add up to the job's total within a sampling interval of an ended thread's work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks.common.run_util import REPO, bench_env

TICKS = os.sysconf("SC_CLK_TCK")

#: The kinds of thread :func:`thread_kind` tells apart.
THREAD_KINDS = ("training", "training_process_other", "torchft", "gloo", "launcher_and_agents")


class CpuSample(NamedTuple):
    """The job's cumulative CPU seconds at ``time`` (``time.monotonic()``), in all and by kind of thread."""

    time: float
    seconds: float
    by_kind: dict[str, float]


def thread_kind(name: str, is_main_thread: bool, in_training_process: bool) -> str:
    """A thread's kind from its name (``comm``): torchft names its quorum thread and its Rust runtimes ``torchft*``
    (the lighthouse's ``torchft-lighths``), torch its Gloo threads ``*gloo*``; a training process's main thread
    trains; the rest of a training process (Python's helper threads, torch's) and every other process of the job
    (the launcher, torchrun's agents) are the other two."""
    if name.startswith("torchft"):
        return "torchft"
    if "gloo" in name:
        return "gloo"
    if not in_training_process:
        return "launcher_and_agents"
    return "training" if is_main_thread else "training_process_other"


def _thread_seconds(pid: int, training_marker: str | None) -> dict[tuple[int, int], tuple[str, float]]:
    """``{(pid, tid): (kind, CPU seconds)}`` of a live process's threads; empty if it is gone."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[1:]
        program = next((argument for argument in arguments if not argument.startswith("-")), "")
        training = training_marker is not None and program.endswith(training_marker)
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        kind = thread_kind(name, int(tid) == pid, training)
        threads[(pid, int(tid))] = (kind, (int(fields[11]) + int(fields[12])) / TICKS)
    return threads


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds)`` of a live process, or ``None`` if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS  # ppid; utime + stime


def tree_cpu_seconds(
    root: int,
    seen: dict[int, float],
    threads_seen: dict[tuple[int, int], tuple[str, float]] | None = None,
    training_marker: str | None = None,
) -> float:
    """The CPU seconds of ``root``'s tree so far: every live descendant read now, and every process seen before that
    has exited since at its last reading (``seen``, updated in place). With ``threads_seen``, also every thread of
    the tree, by kind, the same way (``training_marker``: how the script the training processes run ends; the
    launcher's and torchrun's command lines name it too, further on)."""
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
            if threads_seen is not None:
                threads_seen.update(_thread_seconds(pid, training_marker))
    return sum(seen.values())


def by_kind(threads_seen: dict[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """The CPU seconds of the threads seen so far, summed by kind."""
    totals = dict.fromkeys(THREAD_KINDS, 0.0)
    for kind, seconds in threads_seen.values():
        totals[kind] += seconds
    return totals


def run_job_sampling_cpu(
    command: Sequence[str], log: Path, timeout: float, interval: float = 0.25, training_marker: str | None = None
) -> tuple[int, list[CpuSample]]:
    """Run ``command`` as ``run_util.run_job`` does (its own session, output to ``log``, killed by its session on a
    timeout: ours alone), sampling its tree's CPU. Returns the exit code and the samples. ``training_marker``: how
    the script the training processes run ends (the interpreter's first argument that is not an option, as in
    ``python -u worker.py``; their main threads are the ``training`` kind)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    samples: list[CpuSample] = []
    stop = threading.Event()
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(command), cwd=REPO, env=bench_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        seen: dict[int, float] = {}
        threads_seen: dict[tuple[int, int], tuple[str, float]] = {}

        def sample() -> None:
            while not stop.is_set():
                now = time.monotonic()
                total = tree_cpu_seconds(process.pid, seen, threads_seen, training_marker)
                samples.append(CpuSample(now, total, by_kind(threads_seen)))
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


def _steady_window(
    samples: list[CpuSample], step_ends: list[float], warmup: int
) -> tuple[CpuSample, CpuSample, int] | None:
    """The first sample after the ``warmup``-th step's end, the last before the last step's end, and the steps that
    ended in between; ``None`` when fewer than two samples or no step fall there."""
    if len(step_ends) <= warmup + 1:
        return None
    start, end = step_ends[warmup], step_ends[-1]
    inside = [sample for sample in samples if start <= sample.time <= end]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    steps = sum(1 for t in step_ends if first.time < t <= last.time)
    return (first, last, steps) if steps else None


def cpu_per_step(samples: list[CpuSample], step_ends: list[float], warmup: int) -> float | None:
    """The job's CPU seconds per optimizer step over its steady part (:func:`_steady_window`); ``None`` when it is
    too short to tell."""
    window = _steady_window(samples, step_ends, warmup)
    if window is None:
        return None
    first, last, steps = window
    return (last.seconds - first.seconds) / steps


def cpu_per_step_by_kind(samples: list[CpuSample], step_ends: list[float], warmup: int) -> dict[str, float] | None:
    """:func:`cpu_per_step` split by kind of thread (:data:`THREAD_KINDS`)."""
    window = _steady_window(samples, step_ends, warmup)
    if window is None:
        return None
    first, last, steps = window
    return {kind: (last.by_kind.get(kind, 0.0) - first.by_kind.get(kind, 0.0)) / steps for kind in THREAD_KINDS}

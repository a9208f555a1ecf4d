"""The benchmarks' measure of a whole job's CPU (benchmarks/common/job_cpu.py): the tree is every descendant, the
CPU per step is taken over the steady part only, and each thread is counted under its kind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.common.job_cpu import (
    CpuSample,
    by_kind,
    cpu_per_step,
    cpu_per_step_by_kind,
    thread_kind,
    tree_cpu_seconds,
)

pytestmark = pytest.mark.timeout(60)

# A parent that starts a child in a new session (as lightning-ft launch starts its groups), then both spin.
SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"
PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
    + SPIN.format(seconds=0.6)
    + "child.wait()\n"
)
# A training script whose main thread spins, beside a thread that names itself as torchft names its quorum thread and
# spins as long, then says so and waits for its standard input to close; and a launcher that spins, then runs it (its
# command line names the script too, further on).
TRAINING_SCRIPT = "job_cpu_training.py"
TRAINING = (
    "import ctypes, sys, threading, time\n"
    "def spin(seconds):\n"
    "    end = time.thread_time() + seconds\n"
    "    while time.thread_time() < end: pass\n"
    "spun_beside, released = threading.Event(), threading.Event()\n"
    "def beside():\n"
    "    ctypes.CDLL(None).prctl(15, b'torchft_quorum')  # PR_SET_NAME\n"
    "    spin(0.4)\n"
    "    spun_beside.set()\n"
    "    released.wait()\n"
    "thread = threading.Thread(target=beside)\n"
    "thread.start()\n"
    "spin(0.4)\n"
    "spun_beside.wait()\n"
    "print('spun', flush=True)\n"
    "sys.stdin.read()\n"  # alive, threads and all, until the test has read the tree
    "released.set()\n"
    "thread.join()\n"
)
LAUNCHER = (
    "import subprocess, sys\n" + SPIN.format(seconds=0.3) + "subprocess.run([sys.executable, '-u', sys.argv[1]])\n"
)


def _read_until_exit(process: subprocess.Popen, read) -> None:
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # read the tree until the job ends
            read()
            try:
                process.wait(timeout=0.05)
                return
            except subprocess.TimeoutExpired:
                continue
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_tree_counts_a_descendant_in_another_session_and_keeps_an_exited_ones_cpu():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=SPIN.format(seconds=0.6))])
    seen: dict[int, float] = {}
    _read_until_exit(parent, lambda: tree_cpu_seconds(parent.pid, seen))
    assert len(seen) == 2
    # The child's last reading is kept after it exited; the parent's (gone too) as well: about 0.6 s each at least
    # as far as they were read, and never more than they spun plus start-up.
    assert 0.5 < sum(seen.values()) < 5.0


def test_each_thread_counts_under_its_kind(tmp_path):
    script = tmp_path / TRAINING_SCRIPT
    script.write_text(TRAINING)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    seen: dict[int, float] = {}
    threads: dict[tuple[int, int], tuple[str, float]] = {}
    try:
        assert launcher.stdout is not None and launcher.stdin is not None
        assert launcher.stdout.readline() == "spun\n"  # every spin is over, every thread still there to be read
        tree_cpu_seconds(launcher.pid, seen, threads, training_marker=TRAINING_SCRIPT)
        launcher.stdin.close()
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    kinds = by_kind(threads)
    assert 0.3 < kinds["torchft"] < 1.0  # the named thread's 0.4 s
    assert 0.3 < kinds["training"] < 2.0  # the script's main thread's 0.4 s, plus the interpreter's start-up
    assert 0.2 < kinds["launcher_and_agents"] < 2.0  # the launcher's 0.3 s: its command line names the script later
    assert sum(kinds.values()) <= sum(seen.values()) + 0.05


def test_a_thread_kind_comes_from_its_name_and_its_process():
    assert thread_kind("torchft-lighths", is_main_thread=False, in_training_process=False) == "torchft"
    assert thread_kind("pt_gloo_runloop", is_main_thread=False, in_training_process=True) == "gloo"
    assert thread_kind("python", is_main_thread=True, in_training_process=True) == "training"
    assert thread_kind("python", is_main_thread=False, in_training_process=True) == "training_process_other"
    assert thread_kind("python", is_main_thread=True, in_training_process=False) == "launcher_and_agents"


def test_cpu_per_step_takes_the_samples_between_the_warm_up_and_the_last_step():
    step_ends = [float(t) for t in range(11)]  # a step ends every second, 0 to 10
    samples = [
        CpuSample(t + 0.5, 2.0 * (t + 0.5) + (100.0 if t < 3 else 0.0), {"torchft": 0.5 * (t + 0.5)})
        for t in range(-1, 12)
    ]  # a start-up burst in the first samples
    # Warm-up of 3 steps: the samples from 3.5 to 9.5 span the steps ending at 4 to 9 (6 steps), 12 CPU seconds.
    assert cpu_per_step(samples, step_ends, warmup=3) == pytest.approx(2.0)
    assert cpu_per_step(samples, step_ends[:4], warmup=3) is None  # no steady part
    split = cpu_per_step_by_kind(samples, step_ends, warmup=3)
    assert split is not None and split["torchft"] == pytest.approx(0.5) and split["gloo"] == 0.0

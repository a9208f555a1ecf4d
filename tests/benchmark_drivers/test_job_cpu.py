"""The benchmarks' measure of a whole job's CPU (benchmarks/common/job_cpu.py): the tree is every descendant, and the
CPU per step is taken over the steady part only."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.common.job_cpu import cpu_per_step, tree_cpu_seconds

pytestmark = pytest.mark.timeout(60)

# A parent that starts a child in a new session (as lightning-ft launch starts its groups), then both spin.
SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"
PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
    + SPIN.format(seconds=0.6)
    + "child.wait()\n"
)


def test_the_tree_counts_a_descendant_in_another_session_and_keeps_an_exited_ones_cpu():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=SPIN.format(seconds=0.6))])
    seen: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # read the tree until the job ends
            tree_cpu_seconds(parent.pid, seen)
            try:
                parent.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if parent.poll() is None:
            parent.kill()
    assert len(seen) == 2
    # The child's last reading is kept after it exited; the parent's (gone too) as well: about 0.6 s each at least
    # as far as they were read, and never more than they spun plus start-up.
    assert 0.5 < sum(seen.values()) < 5.0


def test_cpu_per_step_takes_the_samples_between_the_warm_up_and_the_last_step():
    step_ends = [float(t) for t in range(11)]  # a step ends every second, 0 to 10
    samples = [(t + 0.5, 2.0 * (t + 0.5) + (100.0 if t < 3 else 0.0)) for t in range(-1, 12)]  # start-up burst
    # Warm-up of 3 steps: the samples from 3.5 to 9.5 span the steps ending at 4 to 9 (6 steps), 12 CPU seconds.
    assert cpu_per_step(samples, step_ends, warmup=3) == pytest.approx(2.0)
    assert cpu_per_step(samples, step_ends[:4], warmup=3) is None  # no steady part

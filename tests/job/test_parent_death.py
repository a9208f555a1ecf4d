"""``lightning_ft_job.parent_death``: a process asks for a signal when its parent dies, and is signalled at once when
the parent it names is not its parent any more (it died before the request, so the kernel would send nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import describe_process, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

ASK = "from lightning_ft_job.parent_death import signal_on_parent_death; ask = signal_on_parent_death()"


def test_a_parent_that_is_gone_already_means_the_signal_at_once() -> None:
    child = subprocess.run(
        [sys.executable, "-c", f"import os; {ASK}; ask(os.getppid() + 1); import time; time.sleep(30)"], timeout=60
    )
    assert child.returncode == -signal.SIGTERM


def test_the_child_is_signalled_when_its_parent_is_sigkilled() -> None:
    """A parent (a shell-like Python process) starts the child, which asks and reports ready; the parent is then
    SIGKILLed, so none of its code runs, and the kernel alone ends the child."""
    child_code = f"import os, time; {ASK}; print(ask(os.getppid()), flush=True); time.sleep(60)"
    parent_code = (
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE, text=True); "
        "print(child.pid, child.stdout.readline().strip(), flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        pid, asked = parent.stdout.readline().split()
        child_pid = int(pid)
        assert asked == "True", "the child's parent was its parent when it asked"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not process_gone(child_pid):
            assert time.monotonic() < deadline, f"the child outlived its parent: {describe_process(child_pid)}"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if child_pid and not process_gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)

"""``lightning_ft_job.torchrun_agent``: with ``LIGHTNING_FT_STACKS_DIR`` set, SIGUSR1 makes a running agent write every
thread's Python stack to a file, the one view of an agent that does not end once its launcher (and so its output) is
gone. The fault tests read it when an agent outlives its bound (``LaunchedJob.assert_gone_within``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import process_gone

from lightning_ft_job.environment import ENV_STACKS_DIR

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_sigusr1_writes_every_thread_of_a_running_agent_to_its_stacks_file(tmp_path):
    command = [sys.executable, "-m", "lightning_ft_job.torchrun_agent", "--standalone", "--nnodes=1",
               "--nproc-per-node=1", "--max-restarts=0", "--no-python", "sleep", "60"]  # fmt: skip
    agent = subprocess.Popen(
        command, env={**os.environ, ENV_STACKS_DIR: str(tmp_path)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    stacks = tmp_path / f"agent-{agent.pid}.stacks"
    try:
        deadline = time.monotonic() + 90
        # The agent has started its worker (``sleep``): it is in its monitoring loop, in torchrun's own code.
        while not children(agent.pid):
            assert time.monotonic() < deadline and agent.poll() is None, "the agent never started its worker"
            time.sleep(0.1)
        os.kill(agent.pid, signal.SIGUSR1)
        while "most recent call first" not in stacks.read_text():
            assert time.monotonic() < deadline, "no stacks written"
            time.sleep(0.1)
        assert "torch/distributed/elastic" in stacks.read_text(), stacks.read_text()
        assert agent.poll() is None, "SIGUSR1 ended the agent"
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
    assert process_gone(agent.pid)


@pytest.mark.parametrize(("worker", "status"), [("true", 0), ("false", 1)])
def test_the_agent_exits_with_torchruns_status_whether_its_group_finished_or_failed(tmp_path, worker, status):
    """The agent skips the interpreter's teardown after torchrun's ``main`` (returned or raised), with the status
    Python would give: 0 for a group that finished, 1 for one that failed after its last restart (torchrun's
    ``ChildFailedError``, its traceback printed)."""
    command = [sys.executable, "-m", "lightning_ft_job.torchrun_agent", "--standalone", "--nnodes=1",
               "--nproc-per-node=1", "--max-restarts=0", "--no-python", worker]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == status, done.stderr[-3000:]
    if status:
        assert "ChildFailedError" in done.stderr, done.stderr[-3000:]

"""The launcher warns once about each group that never reaches the lighthouse (``lightning_ft_cli/job_state.py``,
``ArrivalWatch``): most likely a script whose Trainer has no FTStrategy, which trains each group alone on the same
data and exits 0. Checked to fail at 6bcf74e, where such a launch said nothing and exited 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft_cli.job_state import ArrivalWatch

WARNING = "without reaching the lighthouse: most likely its Trainer has no FTStrategy"


def launch(tmp_path: Path, *options: str, command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FT_", "REPLICA_GROUP", "NUM_REPLICA"))}
    return subprocess.run(
        [sys.executable, "-m", "lightning_ft_cli", "launch", "--replica-groups=2", "--max-restarts=0", *options,
         "--", sys.executable, "-c", command],
        capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_groups_that_exit_0_without_reaching_the_lighthouse_are_named_once_each(tmp_path):
    """A plain script's groups end at once: each is named when it exits. The job still ends as before, exit 0: the
    warning does not judge the user's script."""
    result = launch(tmp_path, command="print('a plain script')")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    warnings = sorted(line.split(" exited 0")[0] for line in output.splitlines() if WARNING in line)
    assert warnings == [f"lightning-ft launch: warning: replica group {g}" for g in (0, 1)], output[-3000:]


@pytest.mark.multiprocess
@pytest.mark.paths  # its neighbour in make test: the exit path above
@pytest.mark.timeout(120)
def test_groups_still_running_without_reaching_the_lighthouse_are_named_once_each(tmp_path):
    """Each group waits (bounded) until the launcher has named it, then exits 0: named once while it runs, not
    again when it exits."""
    command = (
        "import os, sys, time\ngate = os.path.join(sys.argv[1], 'warned' + os.environ['REPLICA_GROUP_ID'])\n"
        "deadline = time.monotonic() + 60\nwhile not os.path.exists(gate) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FT_", "REPLICA_GROUP", "NUM_REPLICA"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_ft_cli", "launch", "--replica-groups=2", "--max-restarts=0",
         "--warn-unreached-after=1", "--", sys.executable, "-c", command, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            for group in (0, 1):
                if f"replica group {group} has run 1s {WARNING}" in line:
                    (tmp_path / f"warned{group}").touch()
        assert process.wait(timeout=90) == 0, "".join(lines)[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    warnings = [line for line in lines if WARNING in line]
    assert len(warnings) == 2 and all(" has run 1s " in line for line in warnings), "".join(lines)[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_group_that_says_it_arrived_gets_no_warning(tmp_path):
    command = (
        "import os\nfrom lightning_ft_job import arrival\n"
        "arrival.report_arrived(os.environ['LIGHTNING_FT_RUN_ID'], int(os.environ['REPLICA_GROUP_ID']))\n"
    )
    result = launch(tmp_path, command=command)
    assert result.returncode == 0 and WARNING not in result.stdout + result.stderr, result.stdout[-3000:]


def test_the_watch_warns_each_silent_group_once_and_never_a_failed_or_arrived_one():
    now = [0.0]
    watch = ArrivalWatch((0, 1, 2, 3), warn_after=10.0, clock=lambda: now[0])
    assert watch.observe({0: None, 1: None, 2: None, 3: None}, set()) == []
    now[0] = 10.0
    lines = watch.observe({0: None, 1: 3, 2: None, 3: None}, {2})  # 1 failed: its failure says why
    assert [line.split(" has run")[0] for line in lines] == ["warning: replica group 0", "warning: replica group 3"]
    assert watch.observe({0: 0, 1: 3, 2: 0, 3: None}, {2}) == []  # each group once

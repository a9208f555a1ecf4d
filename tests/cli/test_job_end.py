"""The launcher's end, in every order: which group finishes, which straggles, which crashes after its end.

Each group here is a small program that plays one part of a job's end through the real launcher and torchrun agent,
and reports the run's end as a training group's rank 0 does (:mod:`lightning_ft_job.run_end`):

* ``finish``: reports its end, exits 0;
* ``crash_after_finish``: reports its end, then exits 7 (a teardown that crashed after the final state);
* ``straggle``: never ends by itself (a group restarted after its peers finished, waiting for them);
* ``fail_after_end``: waits for the launcher to say the job finished, then exits 5 (a failure of its own after the
  end, never hidden);
* ``fail``: exits 3 at once, before anyone finished (a group that used up its restarts).

The rule under test (``lightning_ft_cli/job_state.py``): the job finished once any group reported its end or exited 0,
whatever the order; the launcher exits 0 within ``--finish-grace`` of that, stopping stragglers; a group that fails
(exits with an error without having finished) fails the launch, before the end or after it. On the launcher at
6bcf74e the orders with a straggler before the finisher hang (its wait loop stopped reading exit codes at the first
running group), and a crash after the end exits 1.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

GRACE_S = 3.0

PLAY = r"""
import os, sys, time
from lightning_ft_job import arrival, run_end
roles, gates = sys.argv[1].split(","), sys.argv[2]
group = int(os.environ["REPLICA_GROUP_ID"])
role = roles[group]
run = os.environ["LIGHTNING_FT_RUN_ID"]
arrival.report_arrived(run, group)  # as a training group's rank 0 does once its Manager is up
where = os.environ["LIGHTNING_FT_RUN_END_DIR"]
def wait_for_gate(name):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(gates, name)):
        assert time.monotonic() < deadline, f"the test's gate {name} never opened"
        time.sleep(0.05)
print("role", role, flush=True)
if role == "fail":
    sys.exit(3)
if role == "straggle":
    time.sleep(600)
if role == "fail_after_end":
    wait_for_gate("ended")  # the launcher has said that the job finished
    sys.exit(5)
if "fail" in roles:
    wait_for_gate("failed")  # the launcher has said that the failing group failed
run_end.report_finished(where, run_end.GroupFinished(run, group, 10, "max_steps=10 reached"))
sys.exit(7 if role == "crash_after_finish" else 0)
"""


FAIL_AFTER_END = ("finish", "straggle", "fail_after_end")


def orders() -> list[tuple[str, ...]]:
    """Every arrangement of each cast over the groups: every group in every part."""
    casts = [
        ("finish", "straggle"),
        ("crash_after_finish", "straggle"),
        ("finish", "straggle", "straggle"),
        ("crash_after_finish", "straggle", "straggle"),
    ]
    return sorted({order for cast in casts for order in itertools.permutations(cast)})


def play(roles: tuple[str, ...], tmp_path: Path) -> tuple[int, str, float]:
    """Launch the groups in their parts; open the gates when the launcher says what they wait for. Returns the
    launcher's exit code, its output, and the seconds from the job's end (as the launcher said it) to its exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FT_", "REPLICA_GROUP", "NUM_REPLICA"))}
    command = [sys.executable, "-m", "lightning_ft_cli", "launch", f"--replica-groups={len(roles)}",
               "--max-restarts=0", f"--finish-grace={GRACE_S}", "--", "python", "-c", PLAY, ",".join(roles),
               str(tmp_path)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               cwd=tmp_path, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    ended_at: list[float] = []

    def follow() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "the job finished" in line and not ended_at:
                ended_at.append(time.monotonic())
                (tmp_path / "ended").touch()
            if re.search(r"replica group \d+ failed", line):
                (tmp_path / "failed").touch()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(timeout=10)
        raise AssertionError(f"the launcher did not end within 90 s:\n{''.join(lines)[-4000:]}") from None
    reader.join(timeout=10)
    return process.returncode, "".join(lines), time.monotonic() - (ended_at[0] if ended_at else 0.0)


@pytest.mark.parametrize("roles", orders(), ids=lambda roles: "-".join(roles))
def test_the_launcher_ends_once_the_job_finished_whatever_the_order(roles, tmp_path):
    code, output, after_end = play(roles, tmp_path)
    assert code == 0, output[-4000:]
    stragglers = [group for group, role in enumerate(roles) if role == "straggle"]
    assert output.count("the job finished (replica group") == 1, output[-4000:]
    if "straggle" in roles:
        late = [group for group, role in enumerate(roles) if role == "straggle"]
        assert f"stopping groups {late}" in output, output[-4000:]
        # The grace counts from the job's end, not from a later exit: the grace plus the stop, with room for load.
        assert after_end < GRACE_S + 30, f"{after_end:.0f}s after the job's end"
    else:
        assert "stopping groups" not in output, output[-4000:]
    for group, role in enumerate(roles):
        if role == "crash_after_finish":
            said = rf"replica group {group} exited with code \d+ after it had finished; it counts as finished"
            assert len(re.findall(said, output)) == 1, output[-4000:]
    assert stragglers, "every cast has a group that is still running when the job finishes"
    assert "failed (exit code" not in output, output[-4000:]


@pytest.mark.parametrize(
    "roles",
    [
        ("finish", "fail"),
        ("fail", "finish"),
        *sorted(set(itertools.permutations(("finish", "straggle", "fail_after_end")))),
    ],
    ids="-".join,
)
def test_a_group_that_failed_before_or_after_the_end_fails_the_job_although_another_finished(roles, tmp_path):
    code, output, _ = play(roles, tmp_path)
    failed = roles.index("fail") if "fail" in roles else roles.index("fail_after_end")
    assert code == 1, output[-4000:]
    assert f"replica group {failed} failed (exit code" in output, output[-4000:]

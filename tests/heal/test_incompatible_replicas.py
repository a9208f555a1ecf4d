"""Replica groups whose models differ, with real processes: the healing group refuses the peer's state, naming the
parameter and both shapes, and fails alone; the healthy group keeps its own state and finishes.

Group 1 is SIGKILLed, and its host's code is changed before torchrun restarts it: it now builds a hidden layer of
width 48 instead of 32. Its restart heals from group 0 at its first quorum, receives a state whose shapes do not fit,
and stops before its first cross-group allreduce: without that early check the gradient buckets of different sizes
would meet in Gloo, which aborts the *healthy* group's process. torchrun restarts group 1 up to ``--max-restarts``;
every attempt is refused the same way, then the launcher reports the group as failed (repeating the error) and exits
non-zero once group 0 has finished. (Groups whose models differ from the job's start are compared by the start's
vote instead: ``tests/start/test_contract.py``.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_contract import edit_group
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

REFUSAL = (
    "IncompatibleReplicaError: parameter 'net.0.weight' has shape (32, 16) on the peer but (48, 16) here: every "
    "replica group must build the same model. Nothing was loaded."
)


def test_a_group_whose_model_differs_is_refused_and_the_healthy_group_finishes_untouched(launch):
    max_steps, restarts = 30, 2
    job = launch(
        groups=2, max_restarts=restarts, worker_args=[f"--max-steps={max_steps}", "--group-args={root}", *GATES]
    )
    start_together(job, groups=2, nproc=1)
    victim = job.worker_pid(1, 0)
    job.wait_for("group 1 to commit 3 steps with group 0", lambda: len(job.committed_steps(1, pid=victim)) >= 3)
    hold = job.hold_from_step(0, max(job.committed_steps(1, pid=victim)) + 6)
    edit_group(job.root, 1, "--hidden-for-group=1:48")
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_held_alone(0, since=killed_at)
    # Group 0 goes on one step at a time while a restart of group 1 asks to join: each restart meets group 0 and heals
    # from it, instead of finding the job over or training alone.
    refused = lambda: len(job.events("exception", group=1, type="IncompatibleReplicaError")) >= restarts  # noqa: E731
    job.release_until_healed({0: hold}, 1, since=killed_at, until=refused)

    assert job.wait_exit() == 1, job.tail()
    log = job.log_path.read_text(errors="replace")
    assert "replica group 1 failed" in log and f"--max-restarts={restarts}" in log, job.tail()
    assert f"Its last error: {REFUSAL}" in log, job.tail(40)

    # Group 1: every restart was refused with the parameter and both shapes, and loaded nothing.
    assert sorted(record["attempt"] for record in job.events("started", group=1)) == list(range(restarts + 1))
    assert log.count(REFUSAL) >= restarts, job.tail(120)
    assert not [e for e in job.events("healed", group=1) if e["time"] > killed_at], "a restart loaded a peer's state"
    assert not job.events("contract_refused"), "the model's structure is named by the training state's own check"

    # Group 0: never restarted (no Gloo abort), never healed, and finished alone with its own model at max_steps.
    assert "EnforceNotMet" not in log, job.tail(120)
    assert [record["attempt"] for record in job.events("started", group=0)] == [0]
    assert job.committed_steps(0) == list(range(1, max_steps + 1))
    states = job.final_states()
    assert list(states) == [(0, 0)], sorted(states)
    state = states[(0, 0)]
    assert state["global_step"] == state["manager_step"] == max_steps
    assert tuple(state["model"]["net.0.weight"].shape) == (32, 16)

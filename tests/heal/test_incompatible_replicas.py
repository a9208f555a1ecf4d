"""Replica groups whose models differ, with real processes: the healing group refuses the peer's state, naming the
parameter and both shapes, and fails alone; the healthy group keeps its own state and finishes.

Group 1 builds a hidden layer of width 48 instead of 32. At the job's first quorum it heals from group 0
(``init_sync``), receives a state whose shapes do not fit, and stops before its first cross-group allreduce: without
that early check the gradient buckets of different sizes would meet in Gloo, which aborts the *healthy* group's
process. torchrun restarts group 1 up to ``--max-restarts``; every attempt is refused the same way, then the launcher
reports the group as failed and exits non-zero once group 0 has finished.
"""

from __future__ import annotations

import pytest
from harness import LaunchedJob
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

REFUSAL = (
    "IncompatibleReplicaError: parameter 'net.0.weight' has shape (32, 16) on the peer but (48, 16) here: every "
    "replica group must build the same model. Nothing was loaded."
)


def let_every_attempt_meet_group_0(job: LaunchedJob, restarts: int) -> None:
    """Group 0 pauses after each batch (its Manager keeps heartbeating) until torchrun's last restart of group 1 is
    about to ask for its first quorum; the lighthouse then holds that request until group 0 asks too, so every
    attempt of group 1 meets group 0 and heals from it, instead of training alone after group 0 has finished."""
    for attempt in range(1, restarts + 1):
        restarted = job.wait_for(
            f"torchrun to restart group 1 (attempt {attempt})", lambda attempt=attempt: job.worker_pid(1, 0, attempt)
        )
        job.wait_for(
            f"attempt {attempt} of group 1 to ask for a quorum",
            lambda restarted=restarted: job.events("joining", pid=restarted),
        )


def test_a_group_whose_model_differs_is_refused_and_the_healthy_group_finishes_untouched(launch):
    max_steps, restarts = 20, 1
    job = launch(
        groups=2, max_restarts=restarts, worker_args=[f"--max-steps={max_steps}", "--hidden-for-group=1:48", *GATES]
    )
    pause = job.root / "pause.group0"
    pause.touch()
    start_together(job, groups=2, nproc=1)
    let_every_attempt_meet_group_0(job, restarts)
    pause.unlink()

    assert job.wait_exit() == 1, job.tail()
    log = job.log_path.read_text(errors="replace")
    assert "replica group 1 failed" in log and f"--max-restarts={restarts}" in log, job.tail()

    # Group 1: every attempt was refused with the parameter and both shapes, and loaded nothing.
    assert sorted(record["attempt"] for record in job.events("started", group=1)) == list(range(restarts + 1))
    assert log.count(REFUSAL) >= restarts + 1, job.tail(120)
    assert not job.events("healed"), "a replica loaded a peer's state"
    assert not job.events("step", group=1, committed=True)

    # Group 0: never restarted (no Gloo abort), never healed, never committed a step together with group 1, and
    # finished with its own model at max_steps.
    assert "EnforceNotMet" not in log, job.tail(120)
    assert [record["attempt"] for record in job.events("started", group=0)] == [0]
    committed = job.events("step", group=0, committed=True)
    assert [record["step"] for record in committed] == list(range(1, max_steps + 1))
    assert all(record["participants"] == 1 for record in committed)
    states = job.final_states()
    assert list(states) == [(0, 0)], sorted(states)
    state = states[(0, 0)]
    assert state["global_step"] == state["manager_step"] == max_steps
    assert tuple(state["model"]["net.0.weight"].shape) == (32, 16)

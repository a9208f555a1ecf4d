"""A training step whose loss leaves a parameter out, under ``FTStrategy(find_unused_parameters=False)``: DDP never
reduces the bucket holding it, so that step's gradients cross no group. Such a step must never commit (each group
would apply its own gradients: one model per group), and the job must say what to change.

Real jobs (a real lighthouse, torchrun groups); the worker's last layer leaves its bias out of the loss at one global
step, in some groups or all. Every group is a dropping one and a keeping one; the first, a middle and the last step.
No group commits the dropping step in a quorum with a group that dropped it, and each dropping group says
``UnusedParameterError`` with the fix. Then, by case: when every group drops the step, the job fails with that error
first; when one does, the other goes on alone and is held until the dropping group's restart has healed from it, past
the step, and the job ends as one model at ``max_steps`` (at the last step there is nothing left to heal into: the
keeping group ends the job alone).

Without the check at the vote (:mod:`lightning_ft.step.unfinished_reduction`), every dropping group commits the
step (its vote has nothing against it), and the first assertion fails.
"""

from __future__ import annotations

import pytest
from harness import LaunchedJob, assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MAX_STEPS = 12
GROUPS = 2
# (the groups whose step leaves the bias out, the global step): each group as the dropping one and as the keeping
# one, the first, a middle and the last step.
CASES = [(dropping, step) for dropping in ((0, 1), (0,), (1,)) for step in (0, 6, MAX_STEPS - 1)]
# `make test` (close to its 20-minute budget) runs one: a group leaves the parameter out, the other goes on and is
# healed from; `make test-extra` runs them all.
IN_MAKE_TEST = {((1,), 6)}


@pytest.mark.parametrize(
    ("dropping", "step"),
    [
        pytest.param(
            *case, marks=() if case in IN_MAKE_TEST else pytest.mark.paths, id=f"groups{case[0]}-step{case[1]}"
        )
        for case in CASES
    ],
)
def test_a_step_that_leaves_a_parameter_out_is_never_committed(launch, dropping: tuple[int, ...], step: int) -> None:
    job = launch(
        groups=GROUPS,
        worker_args=[
            f"--max-steps={MAX_STEPS}",
            "--find-unused-parameters=0",
            f"--unused-bias-at-step={step}",
            f"--unused-bias-groups={','.join(map(str, dropping))}",
            *GATES,
        ],
    )
    keeping = [group for group in range(GROUPS) if group not in dropping]
    heals = bool(keeping) and step < MAX_STEPS - 1
    holds = {group: job.hold_from_step(group, step + 2) for group in keeping} if heals else {}
    start_together(job, groups=GROUPS, nproc=1)
    if heals:
        job.wait_for("the dropping group's restart", lambda: all(job.worker_pid(g, 0, 1) for g in dropping))
        job.release_until_healed(holds, tuple(dropping), since=0)
    code = job.wait_exit()
    dropped_step = step + 1  # the Manager's step that committing global step `step` would make

    for group in range(GROUPS):
        for event in job.events("step", group=group, committed=True, step=dropped_step):
            assert group not in dropping, f"group {group} committed the step it left a parameter out of\n{job.tail()}"
            assert event["participants"] < GROUPS, f"group {group} committed it with a dropping group\n{job.tail()}"

    log = job.log_path.read_text()
    for group in dropping:
        said = [
            line for line in log.splitlines() if line.startswith(f"[group {group}]") and "UnusedParameterError:" in line
        ]
        assert said and "FTStrategy(find_unused_parameters=True)" in said[0] and "(net.2.bias)" in said[0], job.tail()
    if not keeping:
        assert code != 0, job.tail()
        summary = [line for line in log.splitlines() if line.startswith("lightning-ft launch: replica group")]
        # the first error a failed group printed (a restart's own may follow it: no live peer left)
        assert any(
            "Its first error: UnusedParameterError" in line
            or ("Its first error" not in line and "Its last error: UnusedParameterError" in line)
            for line in summary
        ), log[-3000:]
        return
    assert code == 0, job.tail()
    finishing = range(GROUPS) if heals else keeping
    _assert_one_model(job, replicas=[(group, 0) for group in finishing])


def _assert_one_model(job: LaunchedJob, replicas: list[tuple[int, int]]) -> None:
    states = job.final_states()
    assert sorted(states) == replicas, f"expected the final states of {replicas}, got {sorted(states)}\n{job.tail()}"
    for key, state in states.items():
        assert state["global_step"] == MAX_STEPS, f"{key}: global_step {state['global_step']} != {MAX_STEPS}"
        assert state["manager_step"] == MAX_STEPS, f"{key}: manager step {state['manager_step']} != {MAX_STEPS}"
    assert_bit_identical(states, len(replicas))

"""The harness's holds: groups held apart still stop together (``LaunchedJob.wait_held_together``).

Groups stopped "from step S" cannot always reach S on their own: once one stops, the other's next quorum waits at the
lighthouse for it (a lone group of two is no majority) until its quorum timeout ends it. A starved heartbeat puts a
job in that shape (one survivor forms a quorum alone and reaches its hold first); holds at different steps put it
there on purpose, which is how these tests check the helper: a plain wait for each group to stop fails them both.
"""

from __future__ import annotations

import pytest
from harness import assert_bit_identical

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "holds",
    [
        pytest.param({0: 10, 1: 13}, id="group-0-stops-first"),
        pytest.param({0: 13, 1: 10}, id="group-1-stops-first", marks=pytest.mark.paths),
    ],
)
def test_groups_held_at_different_steps_stop_together_at_the_later_one(launch, holds):
    """2 groups × 1 process, held from different steps. The one held first goes on one step at a time while the
    other waits at the lighthouse; both stop at the later hold, commit on to ``max_steps`` once let go, and end as
    two bit-identical replicas."""
    max_steps = 20
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--gate-dir={root}"])
    gates = {group: job.hold_from_step(group, step) for group, step in holds.items()}
    job.wait_for("every worker to start", lambda: all(job.worker_pid(group, 0) for group in holds))
    (job.root / "go").touch()

    assert job.wait_held_together(gates, since=0.0) == max(holds.values())
    for gate in gates.values():
        gate.unlink()
    assert job.wait_exit() == 0, job.tail()

    assert all(len(job.events("started", group=group)) == 1 for group in holds), "no group may have restarted"
    states = job.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=2)

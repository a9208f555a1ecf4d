"""LocalSGD and DiLoCo with real processes: a SIGKILLed group is restarted by torchrun, heals at the next sync
(with DiLoCo: the backup parameters and outer optimizer state too), and every replica ends with bit-identical
parameters after the final sync."""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness import assert_tree_equal
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


@pytest.mark.parametrize(
    ("algorithm", "fragments"),
    [
        pytest.param("local_sgd", 1, id="local_sgd"),
        pytest.param("diloco", 1, id="diloco"),
        pytest.param("diloco", 2, id="streaming-diloco-2-fragments"),
    ],
)
def test_semi_sync_sigkill_one_of_two_groups(launch, algorithm, fragments):
    """2 groups x 1 process, sync every 4 inner steps. The victim is stopped between two syncs (so no sync is cut in
    half) and SIGKILLed; the survivor syncs alone; the restarted group's join sync is the survivor's next sync."""
    max_steps, sync_every = 48, 4
    job = launch(
        groups=2,
        worker_args=[
            f"--max-steps={max_steps}",
            "--async-quorum=0",
            f"--algorithm={algorithm}",
            f"--sync-every={sync_every}",
            *([f"--fragments={fragments}"] if algorithm == "diloco" else []),
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=1)
    attempt = job.attempt(1, 0)
    victim = job.worker_pid(1, 0, attempt)
    job.wait_for(
        "group 1 to commit 3 syncs with its peer",
        lambda: (
            len([e for e in job.events("step", group=1, pid=victim, committed=True) if e["participants"] == 2]) >= 3
        ),
    )
    gate = job.root / "pause.group1.rank0"
    gate.touch()
    job.wait_for("group 1 to stop between two syncs", lambda: job.events("paused", pid=victim))
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    gate.unlink()
    job.wait_for(
        "group 0 to sync on its own",
        lambda: [
            e for e in job.events("step", group=0, committed=True) if e["time"] > killed_at and e["participants"] == 1
        ],
    )
    pause = job.root / "pause.group0"
    pause.touch()
    restarted = job.wait_for("torchrun to restart group 1", lambda: job.worker_pid(1, 0, attempt + 1))
    job.wait_for("group 1 to ask for its join sync", lambda: job.events("joining", pid=restarted))
    pause.unlink()

    assert job.wait_exit() == 0, job.tail()
    heals = job.events("healed", group=1, pid=restarted)
    assert heals and heals[0]["step"] > 0, f"the restarted group never healed from a live peer\n{job.tail()}"
    joins = [e for e in job.events("step", pid=restarted) if e.get("sync") == "join"]
    assert joins and joins[0]["committed"] and joins[0]["participants"] == 2, joins

    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0)], sorted(states)
    # The job's join sync, one per sync period (sync_every / fragments), and the final sync's other fragments.
    expected_syncs = 1 + max_steps // (sync_every // fragments) + (fragments - 1)
    for key, state in states.items():
        assert state["global_step"] == max_steps, f"{key}: global_step {state['global_step']} != {max_steps}"
        assert state["manager_step"] == expected_syncs, f"{key}: manager step {state['manager_step']}"
    # Parameters and the LR schedule are identical; each group keeps its own inner optimizer state (only parameters,
    # or pseudo-gradients, are averaged).
    for name in ("model", "lr_schedulers", "lrs"):
        assert_tree_equal(states[(0, 0)][name], states[(1, 0)][name], name)

"""Elastic membership with real processes: a late group joins and leaves for good; hot spares
(``FTStrategy(world_size_mode="fixed_with_spares")``).

With spares: three replica groups and ``min_replica_size=2``. Two groups contribute to every step; the third is a
hot spare that applies every committed step (so it stays healed) but contributes zero. When an active group dies,
the spare takes its place at the next quorum without a heal, and every committed step keeps the same effective
batch: two groups."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import pytest
from harness import LaunchedJob, assert_bit_identical, launch_job
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def roles(job: LaunchedJob, group: int, after: float = 0.0) -> list[Any]:
    """The group's participating rank in each quorum it saw after ``after`` (``None``: it was a spare)."""
    return [e["replica_rank"] for e in job.events("quorum", group=group) if e["time"] > after]


# In `make test-extra` (`make test` stays under 20 minutes): a late group joining runs in `make test`.
@pytest.mark.paths
@pytest.mark.timeout(300)
def test_a_hot_spare_takes_a_dead_active_groups_place_at_the_same_effective_batch(launch):
    max_steps = 80
    job = launch(
        groups=3,
        worker_args=[f"--max-steps={max_steps}", "--min-replica-size=2", "--world-size-mode=fixed_with_spares", *GATES],
    )
    start_together(job, groups=3, nproc=1)
    job.wait_for("every group to commit 3 steps", lambda: all(len(job.committed_steps(g)) >= 3 for g in range(3)))
    current = {g: roles(job, g)[-1] for g in range(3)}
    spares = [g for g, rank in current.items() if rank is None]
    assert len(spares) == 1, f"exactly one group must be a spare: {current}"
    (spare,) = spares
    victim, survivor = sorted(g for g in range(3) if g != spare)[::-1]  # kill an active group

    attempt = job.attempt(victim, 0)
    killed_at = time.time()
    os.kill(job.worker_pid(victim, 0, attempt), signal.SIGKILL)
    job.wait_for(
        f"spare group {spare} to commit 3 steps as an active group",
        lambda: (
            any(rank is not None for rank in roles(job, spare, after=killed_at))
            and len([e for e in job.events("step", group=spare, committed=True) if e["time"] > killed_at]) >= 3
        ),
    )
    # Hold both until the restarted victim asks for its first quorum, so that it rejoins before they finish.
    for group in (spare, survivor):
        (job.root / f"pause.group{group}").touch()
    restarted = job.wait_for(f"torchrun to restart group {victim}", lambda: job.worker_pid(victim, 0, attempt + 1))
    job.wait_for(f"group {victim} to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    resumed_at = time.time()
    for group in (spare, survivor):
        (job.root / f"pause.group{group}").unlink()
    assert job.wait_exit() == 0, job.tail()

    # The effective batch never changed: every step any group committed had exactly 2 contributing groups.
    commits = [e for e in job.events("step", committed=True)]
    assert commits and {e["participants"] for e in commits} == {2}, sorted({e["participants"] for e in commits})
    # The spare took over without a heal: until the pause ended, its only heal is init_sync's at the start. (After
    # it, the two released groups race to the next quorum; one that misses it falls a step behind and heals, as any
    # late group does, so later heals say nothing about the takeover.)
    takeover_heals = [e["step"] for e in job.events("healed", group=spare) if e["time"] < resumed_at]
    assert takeover_heals in ([], [0]), job.events("healed", group=spare)
    # The restarted victim healed from a live group and became the spare.
    heals = job.events("healed", group=victim, pid=restarted)
    assert heals and heals[0]["step"] > 0, job.tail()
    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0), (2, 0)], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == max_steps and state["manager_step"] == max_steps, (key, state["global_step"])
    assert_bit_identical(states, replicas=3)


@pytest.mark.timeout(300)
def test_a_late_group_joins_heals_adds_throughput_and_leaves_for_good(tmp_path):
    """Group 0 trains alone; group 1, started later by a second ``lightning-ft launch --group-ids 1`` against the
    first one's lighthouse, joins at the next quorum, heals and contributes; then it is stopped for good, and group 0
    carries on alone to max_steps."""
    max_steps = 150
    root = tmp_path / "job"
    port = free_port()
    first = launch_job(
        root,
        groups=2,
        worker_args=[f"--max-steps={max_steps}", *GATES],
        # --start-timeout=0: the job starts with the groups present instead of waiting for group 1.
        launcher_args=[f"--lighthouse-bind=127.0.0.1:{port}", "--group-ids=0", "--start-timeout=0"],
        log_name="first.log",
    )
    late: LaunchedJob | None = None
    try:
        first.wait_for("group 0 to start", lambda: first.worker_pid(0, 0))
        hold = first.hold_from_step(0, 10)  # alone it would finish before the late group has imported torch
        (root / "go").touch()
        first.wait_for("group 0 to commit 10 steps alone and stop", lambda: first.events("paused", phase="from_step"))
        late = launch_job(
            root,
            groups=2,
            worker_args=[f"--max-steps={max_steps}", *GATES],
            launcher_args=[f"--lighthouse=http://127.0.0.1:{port}", "--group-ids=1"],
            log_name="late.log",
        )
        joined = late.wait_for("group 1 to ask for its first quorum", lambda: late.events("joining", group=1))
        hold.unlink()
        late.wait_for(
            "group 1 to commit 5 steps with group 0",
            lambda: len([e for e in late.events("step", group=1, committed=True) if e["participants"] == 2]) >= 5,
        )
        left_at = time.time()
        late.stop()  # for good: SIGTERM to its launcher, which stops its torchrun job
        assert first.wait_exit() == 0, first.tail()
    finally:
        first.stop()
        if late is not None:
            late.stop()

    heals = first.events("healed", group=1)
    assert heals and heals[0]["step"] >= 10 and heals[0]["time"] > joined[0]["time"], heals
    together = [e for e in first.events("step", group=0, committed=True) if e["participants"] == 2]
    assert together, "group 1 never contributed to a step"
    alone_after = [e for e in first.events("step", group=0, committed=True) if e["time"] > left_at]
    assert alone_after and alone_after[-1]["participants"] == 1, alone_after[-3:]
    states = first.final_states()
    assert sorted(states) == [(0, 0)], sorted(states)  # group 1 left before the end
    assert states[(0, 0)]["global_step"] == max_steps and states[(0, 0)]["manager_step"] == max_steps

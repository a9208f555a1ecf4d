"""No survivor waits out a collective timeout: a bound on every kill, on every path that crosses groups.

Each test sets a long collective timeout (``--timeout=120``) and holds its victim exactly where the stall would be:
in a quorum member's rendezvous, or left behind in a collective of the DDP hook, the FSDP2 hook, a DiLoCo sync or a
validation section. Each asserts that the group waiting there goes on within a deadline far shorter than the
timeout, and that the job still ends with bit-identical replicas at the exact step count.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness import LaunchedJob, assert_tree_equal
from test_failure_injection import assert_identical_at, inject
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def assert_semi_sync_identical_at(job: LaunchedJob, *, max_steps: int, syncs: int, replicas: int) -> None:
    """As ``assert_identical_at`` for LocalSGD/DiLoCo: what the syncs make equal (the outer state, the model, the
    schedulers) is bit-identical in every replica; each group's inner optimizer is its own."""
    assert job.wait_exit() == 0, job.tail()
    states = job.final_states()
    assert len(states) == replicas, sorted(states)
    first = next(iter(states.values()))
    for key, state in states.items():
        assert state["global_step"] == max_steps and state["manager_step"] == syncs, (key, state["manager_step"])
        for name in ("outer_state", "model", "lr_schedulers", "lrs"):
            assert_tree_equal(first[name], state[name], f"{key} {name}")


# Far shorter than the 120-s collective timeout the jobs run with.
DEADLINE_S = 60.0


@pytest.mark.compat
def test_a_member_dead_before_the_rendezvous_of_its_quorum_is_given_up_not_waited_for(launch):
    """3 groups × 1 process, at least 2 per quorum. Group 2 is killed and restarted; groups 0 and 1 train on and are
    held. The restarted group 2 asks for its first quorum and is SIGKILLed while its request waits at the lighthouse
    (no quorum of one). Its heartbeats stay fresh for 10 s (the test's heartbeat timeout), so when 0 and 1 ask, the
    quorum forms with the dead group in it; the membership changed, so every member builds a new process group, and
    Gloo's rendezvous would wait the whole 120-s timeout for the dead member's address. Instead, 0 and 1 give that
    quorum up when group 2 does not arrive (``quorum_member_missing``) and commit on their own at the next one. Group
    2 restarts once more, heals, and the job ends with three bit-identical replicas."""
    max_steps = 60
    job = launch(
        groups=3,
        worker_args=[f"--max-steps={max_steps}", "--timeout=120", *GATES],
        launcher_args=["--heartbeat-timeout-ms=10000", "--min-replicas=2"],
        max_restarts=3,
    )
    start_together(job, groups=3, nproc=1)
    first = job.worker_pid(2, 0, 0)
    job.wait_for("group 2 to commit 3 steps", lambda: len(job.committed_steps(2, pid=first)) >= 3)
    held_at = max(job.committed_steps(2, pid=first)) + 10
    holds = [job.hold_from_step(group, held_at) for group in (0, 1)]
    os.kill(first, signal.SIGKILL)
    restarted = job.wait_for("torchrun to restart group 2", lambda: job.worker_pid(2, 0, 1))
    for group in (0, 1):
        job.wait_for(f"group {group} to stop at its hold", lambda g=group: job.events("paused", group=g))
    job.wait_for("the restarted group 2 to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    job.wait_quorum_requests("its request to wait at the lighthouse")
    (job.root / "go").unlink()  # group 2's next restart waits until the survivors are past the dead quorum
    killed_at = time.time()
    os.kill(restarted, signal.SIGKILL)
    for group in (0, 1):  # on, to 3 steps later: the job must not end before group 2 is back
        job.hold_from_step(group, held_at + 3)
    job.wait_for(
        "groups 0 and 1 to give the quorum with the dead group up",
        lambda: all(job.events("quorum_member_missing", group=g) for g in (0, 1)),
        timeout=DEADLINE_S,
    )

    def first_commits_after_the_kill() -> list[float] | None:
        times = [
            [e["time"] for e in job.events("step", group=g, committed=True, participants=2) if e["time"] > killed_at]
            for g in (0, 1)
        ]
        return [min(t) for t in times] if all(times) else None

    resumed = job.wait_for("groups 0 and 1 to commit again, on their own", first_commits_after_the_kill, DEADLINE_S)
    (job.root / "go").touch()
    last = job.wait_for("group 2's second restart", lambda: job.worker_pid(2, 0, 2))
    job.wait_for("it to ask for its first quorum", lambda: job.events("joining", pid=last))
    for hold in holds:
        hold.unlink()
    assert_identical_at(job, max_steps=max_steps, committed=max_steps, replicas=3)
    stall = max(resumed) - killed_at
    assert stall < DEADLINE_S, f"the survivors stalled {stall:.1f}s after the kill"
    for missing in job.events("quorum_member_missing"):
        assert "replica rank(s) [2]" in missing["reason"] and missing["waited_s"] < 5.0, missing
    assert len(job.events("started", group=2)) == 3 and job.events("healed", group=2, pid=last), job.tail()


# Worker arguments; the global step of the stuck collective; where groups 0 and 1 are held until group 2 gave up
# (after their next quorum, whose reconfiguration is what group 2 reads); the Manager's committed steps at the end
# (40 optimizer steps, or the first sync and 10 DiLoCo syncs). FSDP2 without ``fsdp_wrap`` reduces one flat shard
# per step: a group held in one of several sequential allreduces would hold its peers in the next one, a case no
# real loss of a send makes.
LEFT_BEHIND_PATHS = [
    pytest.param([], 8, 12, 40, id="ddp-hook", marks=pytest.mark.compat),
    pytest.param(["--data-parallel=fsdp", "--async-quorum=0"], 8, 12, 40, id="fsdp2-hook"),
    pytest.param(["--algorithm=diloco", "--sync-every=4", "--async-quorum=0"], 8, 14, 11, id="diloco-sync"),
]


@pytest.mark.parametrize(("path_args", "step", "held_at", "committed"), LEFT_BEHIND_PATHS)
def test_a_group_left_behind_in_a_collective_gives_it_up_and_heals_without_waiting_for_the_timeout(
    launch, path_args, step, held_at, committed
):
    """Group 2's first cross-group collective at ``step`` runs (groups 0 and 1 complete it and go on) but never
    completes in group 2, which keeps heartbeating: what a survivor sees when Gloo loses a send after a peer died in
    the collective. Groups 0 and 1 form the next quorum without it; group 2 reads their moved-on marker, gives the
    collective up (its step or sync does not commit), and heals at a later quorum, in the same process. The 120-s
    collective timeout is never what ends it: the injected collective would fail with its own message. Groups 0 and
    1 are held (heartbeating) until group 2 has given up, so that the job cannot end first. (Three groups: the
    lighthouse forms a quorum of a majority of the heartbeating groups only, and group 2 keeps heartbeating.)"""
    max_steps = 40
    stuck = {"kind": "stuck", "group": 2, "step": step, "at": "allreduce"}
    job = launch(groups=3, worker_args=[f"--max-steps={max_steps}", "--timeout=120", inject(stuck), *path_args, *GATES])
    holds = [job.hold_from_step(group, held_at) for group in (0, 1)]
    start_together(job, groups=3, nproc=1)
    [given_up] = job.wait_for(
        "group 2 to give its collective up", lambda: job.events("collective_left_behind"), timeout=DEADLINE_S
    )
    for hold in holds:
        hold.unlink()
    if "--algorithm=diloco" in path_args:  # each group's inner optimizer is its own: the outer state is shared
        assert_semi_sync_identical_at(job, max_steps=max_steps, syncs=committed, replicas=3)
    else:
        assert_identical_at(job, max_steps=max_steps, committed=committed, replicas=3)
    [injected] = job.events("failure_injected")
    assert given_up["group"] == 2 and given_up["newer_quorum_id"] > given_up["quorum_id"], given_up
    assert given_up["waited_s"] < DEADLINE_S and given_up["time"] - injected["time"] < DEADLINE_S, given_up
    assert len(job.events("process_group_set_aside", group=2)) == 1
    assert len(job.events("started", group=2)) == 1, "the stuck group must go on in the same process"
    heals = [e for e in job.events("healed", group=2) if e["time"] > given_up["time"]]
    assert heals, f"group 2 did not heal after giving the collective up\n{job.tail()}"
    for group in (0, 1):
        assert not job.events("step", group=group, committed=False), f"group {group} lost a step"
    assert "stuck allreduce timed out" not in job.log_path.read_text(errors="replace")


# Worker arguments; the step after which group 2 is held before its gate into the next collective (a validation
# every 5 steps of LocalSGD, a sync every 20; a consistency check every 5 DDP steps, which runs after the test's hold
# at the end of batch 5; DiLoCo's sync at step 4); the Manager's committed steps or syncs at the end (for DiLoCo the
# join sync and 10 syncs, less the one that the kill fails for every group); the launcher's arguments.
#
# LocalSGD's restarted group waits at the lighthouse from its first batch until the survivors' final sync, 15 inner
# steps and two validations later. The lighthouse waits for a heartbeating straggler only ``join_timeout_ms`` from
# its *earliest* waiting member, here the restarted group, and with it counted a lone survivor is a majority: with
# the launcher's 300-ms default, a survivor that reaches the final sync a moment before the other would go on
# without it (docs/semi-sync.md, "Three or more groups";
# tests/manager/test_lighthouse_semantics.py pins that behaviour). So this job runs with the join timeout that
# page asks for: longer than the time between two quorums.
SECTIONS = [
    pytest.param(
        ["--algorithm=local_sgd", "--sync-every=20", "--async-quorum=0", "--val-every=5"],
        3,
        3,
        ["--join-timeout-ms=30000"],
        id="validation",
        marks=pytest.mark.paths,  # `make test` runs the consistency check's collective
    ),
    pytest.param(["--consistency-every=5"], 5, 40, [], id="consistency-check"),
    pytest.param(
        ["--algorithm=diloco", "--sync-every=4", "--async-quorum=0"],
        2,
        10,
        [],
        id="diloco-sync",
        marks=pytest.mark.paths,
    ),
]


@pytest.mark.parametrize(("section_args", "victim_held_at", "committed", "launcher_args"), SECTIONS)
def test_a_group_killed_inside_a_cross_group_collective_the_survivors_go_on_without_it(
    launch, section_args, victim_held_at, committed, launcher_args
):
    """3 groups × 1 process. Group 2 is held inside its next cross-group collective (a LocalSGD validation's, a DDP
    consistency check's, a DiLoCo sync's), where groups 0 and 1 wait for it in the same collective, and is SIGKILLed
    there; its restart is held until they have committed without it. The survivors' collective fails (in one of
    them it may stay pending, its send lost: it gives it up on the abandoned marker the other writes), they form a
    quorum of two and commit again, well within the 120-s collective timeout, without waiting for group 2 to come
    back. Group 2 restarts and heals; three replicas end bit-identical."""
    max_steps = 40
    job = launch(
        groups=3,
        worker_args=[f"--max-steps={max_steps}", "--timeout=120", *section_args, *GATES],
        launcher_args=launcher_args,
    )
    victim_hold = job.hold_from_step(2, victim_held_at)
    survivor_holds = [job.hold_from_step(group, 25) for group in (0, 1)]
    start_together(job, groups=3, nproc=1)
    victim = job.worker_pid(2, 0, 0)
    job.wait_for("group 2 to stop at its hold", lambda: job.events("paused", group=2, phase="from_step"))
    (job.root / "pause.group2.allreduce").touch()
    victim_hold.unlink()
    job.wait_for("group 2 to stop in the section's collective", lambda: job.events("paused", phase="allreduce"))
    (job.root / "go").unlink()  # group 2's restart waits until the survivors have gone on without it
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    (job.root / "pause.group2.allreduce").unlink()
    job.wait_held_together(dict(zip((0, 1), survivor_holds, strict=True)), since=killed_at, timeout=DEADLINE_S)
    resumed = max(
        min(e["time"] for e in job.events("step", group=g, committed=True) if e["time"] > killed_at) for g in (0, 1)
    )
    (job.root / "go").touch()
    restarted = job.wait_for("torchrun to restart group 2", lambda: job.worker_pid(2, 0, 1))
    job.wait_for("the restarted group 2 to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    for hold in survivor_holds:
        hold.unlink()
    if "--consistency-every=5" in section_args:
        assert_identical_at(job, max_steps=max_steps, committed=committed, replicas=3)
    else:
        assert_semi_sync_identical_at(job, max_steps=max_steps, syncs=committed, replicas=3)
    assert resumed - killed_at < DEADLINE_S, f"the survivors committed again {resumed - killed_at:.1f}s after the kill"
    assert job.events("healed", group=2, pid=restarted), job.tail()
    for group in (0, 1):
        assert len(job.events("started", group=group)) == 1, f"group {group} must stay up throughout"

"""Kill a replica group for real and check what survives: real lighthouse, torchrun restarts, SIGKILL by PID.

The test drives timing through file gates in the worker (see ``TestGates``), never through sleeps: all groups start
together, the victim is killed after committing steps with its peer, the survivor must commit on its own, and is
then paused (Manager still heartbeating) until the restarted victim has healed from it, so the run cannot end before
the restarted group rejoins, however many restarts that takes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness import LaunchedJob, assert_bit_identical, assert_listeners_confined, process_gone
from matrix import record

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

GATES = ["--gate-dir={root}"]


def start_together(job: LaunchedJob, groups: int, nproc: int) -> None:
    job.wait_for(
        "every worker's Manager to start",
        lambda: all(job.worker_pid(g, r) for g in range(groups) for r in range(nproc)),
    )
    (job.root / "go").touch()


def kill_and_restart(job: LaunchedJob, *, victim: int, rank: int, survivor: int, nproc: int = 1) -> float:
    """SIGKILL ``victim``'s worker ``rank`` after it committed steps together with its peer; let the survivor
    commit alone; hold the survivor until the restarted victim has healed from it (:meth:`LaunchedJob.release_until_
    healed`: one step at a time while the victim asks to join, whatever number of restarts that takes). Returns the
    time of the kill.

    The survivor's pause is set before the kill, at a step well past the victim's last one seen (the victim may
    commit a few more before the SIGKILL lands): a pause set after the survivor's solo commits could come after it
    has already run to ``max_steps``."""
    attempt = job.attempt(victim, rank)
    pid = job.worker_pid(victim, rank, attempt)
    job.wait_for(
        f"group {victim} to commit 3 steps with its peer",
        lambda: (
            len(
                [
                    e
                    for e in job.events("step", group=victim, rank=rank, pid=pid, committed=True)
                    if e["participants"] == 2
                ]
            )
            >= 3
        ),
    )
    hold = job.hold_from_step(survivor, max(job.committed_steps(victim, rank, pid)) + 20)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    job.wait_held_alone(survivor, since=killed_at)
    restarted = job.wait_for(
        f"torchrun to restart group {victim}",
        lambda: (
            all(job.worker_pid(victim, r, attempt + 1) for r in range(nproc))
            and [job.worker_pid(victim, r, attempt + 1) for r in range(nproc)]
        ),
    )
    job.wait_for(
        f"restarted group {victim} to ask for its first quorum",
        lambda: all(job.events("joining", group=victim, pid=pid) for pid in restarted),
    )
    job.release_until_healed({survivor: hold}, victim, since=killed_at)
    return killed_at


def assert_outcome(job: LaunchedJob, *, restarted: int, max_steps: int, replicas: int) -> None:
    """The job ended at ``max_steps`` with ``replicas`` bit-identical final states; group ``restarted`` healed from a
    live peer, and every other group stayed up throughout (one process lifetime per rank: a survivor that crashed
    and healed from the restarted group would otherwise pass)."""
    assert job.wait_exit() == 0, job.tail()
    lifetimes: dict[tuple[int, int], int] = {}
    for start in job.events("started"):
        if start["group"] != restarted:
            key = (start["group"], start["rank"])
            lifetimes[key] = lifetimes.get(key, 0) + 1
    assert lifetimes, f"no surviving group\n{job.tail()}"
    restarted_survivors = {key: count for key, count in lifetimes.items() if count != 1}
    assert not restarted_survivors, f"surviving (group, rank) restarted: {restarted_survivors}\n{job.tail()}"

    restarted_pid = job.worker_pid(restarted, 0)
    heals = job.events("healed", group=restarted, pid=restarted_pid)
    assert heals and heals[0]["step"] > 0, f"restarted group {restarted} never healed from a live peer\n{job.tail()}"

    states = job.final_states()
    assert len(states) == replicas, f"expected {replicas} final states, got {sorted(states)}\n{job.tail()}"
    for key, state in states.items():
        assert state["global_step"] == max_steps, f"{key}: global_step {state['global_step']} != {max_steps}"
        assert state["manager_step"] == max_steps, f"{key}: manager step {state['manager_step']} != {max_steps}"
    assert_bit_identical(states, replicas)
    fingerprints = {record["fingerprint"] for record in job.events("finished")}
    assert len(fingerprints) == 1, fingerprints


@pytest.mark.compat
def test_sigkill_one_of_two_groups(launch):
    """2 groups x 1 process, asynchronous quorum, heal over HTTP (the defaults): the survivor keeps committing, the
    restarted group heals, replicas end identical. (Synchronous quorum with a process-group heal: the validation kill
    below.)"""
    max_steps = 60
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--async-quorum=1", "--transport=http", *GATES])
    start_together(job, groups=2, nproc=1)
    killed_at = kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)
    record("SIGKILL of a group between steps (async quorum, http heal)", job, failed_at=killed_at, victim=1,
           survivors=[0])  # fmt: skip


def test_a_restart_that_dies_after_asking_to_join_is_waited_for_until_the_next_one_heals(launch):
    """The victim's first restart asks to join and dies before it heals (a slow or failed restart, as a loaded machine
    makes one); its second restart heals. The survivor waits for the heal, not for the first request to join: on a
    gate released at that request (6bcf74e's), the survivor runs to ``max_steps`` alone while the second restart
    starts, which then finds the run ended, and the job ends with one final state instead of two."""
    max_steps = 60
    job = launch(groups=2, max_restarts=3, worker_args=[f"--max-steps={max_steps}", "--die-after-joining=1:1", *GATES])
    start_together(job, groups=2, nproc=1)
    kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert job.events("dying_after_joining", group=1), job.tail()
    assert job.attempt(1, 0) == 2, "the second restart is the one that heals"
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)


def test_without_unused_parameter_search_the_restarted_group_s_gradients_line_up_with_its_peer_s(launch):
    """``find_unused_parameters=False``: DDP would lay the restarted group's first-step gradients out in one bucket
    in parameter order against its peer's rebuilt, backward-ordered one; the pinned layout keeps them in line, and
    the replicas end identical."""
    max_steps = 40
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--find-unused-parameters=0", *GATES])
    start_together(job, groups=2, nproc=1)
    kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)


@pytest.mark.paths  # make test kills a rank of a 2-process group with accumulation and clipping under HSDP
def test_sigkill_rank_of_two_process_group_with_accumulation(launch):
    """2 groups x 2 processes (torchrun), accumulation and clipping: killing one rank restarts its whole group,
    which gets a fresh store, heals, and rejoins."""
    max_steps = 40
    job = launch(
        groups=2,
        nproc_per_group=2,
        worker_args=[f"--max-steps={max_steps}", "--accumulate=2", "--clip=0.5", *GATES],
    )
    start_together(job, groups=2, nproc=2)
    # A local job keeps its listeners (store, ManagerServer, checkpoint server, Gloo) on loopback.
    assert_listeners_confined(job, groups=2, nproc=2)
    killed_at = kill_and_restart(job, victim=1, rank=1, survivor=0, nproc=2)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=4)
    record("SIGKILL of one rank of a 2-process group", job, failed_at=killed_at, victim=1, survivors=[0])


def test_sigterm_ends_a_rank_blocked_in_a_synchronous_quorum(launch):
    """When torchrun tears a group down, a rank waiting for its dead peer must not sit out torchrun's 30 s grace
    (nor the quorum timeout): its Manager would keep the group looking alive to the lighthouse.

    The quorum timeout is 10 minutes, so that the exit can only come from the SIGTERM deadline (5 s): the test
    waits for it with a deadline of 2 minutes, which a loaded machine cannot outlast by accident."""
    job = launch(
        groups=1,
        nproc_per_group=2,
        max_restarts=0,
        worker_args=["--max-steps=100000", "--async-quorum=0", "--quorum-timeout=600", *GATES],
    )
    start_together(job, groups=1, nproc=2)
    rank0, rank1 = job.worker_pid(0, 0), job.worker_pid(0, 1)
    job.wait_for("rank 1 to commit 3 steps", lambda: len(job.committed_steps(0, rank=1)) >= 3)
    (job.root / "pause.group0.rank1").touch()
    job.wait_for("rank 1 to pause", lambda: job.events("paused", pid=rank1))
    os.kill(rank0, signal.SIGTERM)  # rank 0 is now waiting for rank 1 in the next synchronous quorum
    job.wait_for("the SIGTERMed rank to exit", lambda: process_gone(rank0), timeout=120)
    assert job.events("sigterm", pid=rank0), "the rank did not say why it stopped"


def test_sigkill_during_validation_leaves_the_survivor_running(launch):
    """Validation is group-local: a group killed while it validates costs the survivor only the heartbeat timeout,
    and the restarted group heals as usual. Synchronous quorum, heal over the process group (the other settings of
    the kill between steps above)."""
    max_steps = 60
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--val-every=10", "--async-quorum=0",
                                        "--transport=pg", *GATES])  # fmt: skip
    (job.root / "pause.group1.validation").touch()  # group 1 will stop inside its first validation
    start_together(job, groups=2, nproc=1)
    attempt = job.attempt(1, 0)
    victim = job.worker_pid(1, 0, attempt)
    paused = job.wait_for(
        "group 1 to stop inside validation", lambda: job.events("paused", pid=victim, phase="validation")
    )
    hold = job.hold_from_step(0, paused[0]["step"] + 20)  # set before the kill: see kill_and_restart
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    (job.root / "pause.group1.validation").unlink()
    job.wait_held_alone(0, since=killed_at)
    restarted = job.wait_for("torchrun to restart group 1", lambda: job.worker_pid(1, 0, attempt + 1))
    job.wait_for("group 1 to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    job.release_until_healed({0: hold}, 1, since=killed_at)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)
    job.assert_peer_deaths_were_one_line_each(survivor=0)  # a traceback at 6bcf74e (torchft's, in validation)
    record("SIGKILL of a group inside validation (sync quorum, pg heal)", job, failed_at=killed_at, victim=1,
           survivors=[0])  # fmt: skip


# In `make test-extra` (`make test` stays under 20 minutes): one group killed and healed runs in `make test`.
@pytest.mark.paths
def test_two_of_three_groups_killed_at_once_both_heal_from_the_third(launch):
    """3 groups × 1 process. Groups 1 and 2 are SIGKILLed at the same moment, wherever they are in a step. A quorum
    needs all 3 groups (lighthouse and ``min_replica_size``), so group 0 waits in its quorum request, commits
    nothing on its own, and is in the first quorum the restarted groups join: both heal from it, the same source, at
    the same time, and the three replicas end bit-identical at ``max_steps`` with no committed step lost."""
    max_steps = 40
    job = launch(
        groups=3,
        launcher_args=["--min-replicas=3"],
        worker_args=[f"--max-steps={max_steps}", "--min-replica-size=3", "--quorum-timeout=180", *GATES],
    )
    start_together(job, groups=3, nproc=1)
    attempts = {group: job.attempt(group, 0) for group in (1, 2)}
    victims = {group: job.worker_pid(group, 0, attempts[group]) for group in (1, 2)}
    job.wait_for(
        "the three groups to commit 3 steps together",
        lambda: sum(e["participants"] == 3 for e in job.events("step", group=0, committed=True)) >= 3,
    )
    # Wherever the two victims are: no step commits without all three groups, and a step that group 0 commits after
    # their allreduce completed is the state they heal to. (Pausing them first at a batch end cannot work: once one
    # stops, the other waits in its next quorum and never reaches one.)
    killed_at = time.time()
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    assert job.wait_exit() == 0, job.tail()

    assert len(job.events("started", group=0)) == 1, "group 0 must stay up throughout"
    final_step = max(job.committed_steps(0, pid=job.worker_pid(0, 0)) or [0])
    for group in (1, 2):
        restarted = job.worker_pid(group, 0, attempts[group] + 1)
        assert restarted, f"torchrun did not restart group {group}"
        heals = job.events("healed", group=group, pid=restarted)
        assert heals and heals[0]["step"] > 0, f"group {group} never healed from a live peer\n{job.tail()}"
    assert final_step == max_steps
    solo = [e for e in job.events("step", group=0, committed=True) if e["participants"] == 1]
    assert not solo, f"group 0 committed alone although a quorum needs 3 groups: {solo}"
    healed_at = {job.events("healed", group=g, pid=job.worker_pid(g, 0))[0]["step"] for g in (1, 2)}
    assert len(healed_at) == 1, f"the two restarted groups healed at different steps: {healed_at}"
    states = job.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=3)
    record("SIGKILL of two of three groups at once", job, failed_at=killed_at, victim=1, survivors=[0])


def test_the_heal_source_killed_mid_send_the_healer_heals_from_another_peer(launch):
    """3 groups × 1 process. Group 2 is killed and restarts; the survivor chosen to send it the live state (over
    HTTP) sends half of the bytes and is SIGKILLed there, its healer's fetch still open. The healer's step fails and
    commits nowhere; the next quorum, without the dead source, heals it from the other survivor; the source restarts
    and heals too. Three bit-identical replicas at ``max_steps``, no committed step lost."""
    max_steps = 50
    job = launch(groups=3, worker_args=[f"--max-steps={max_steps}", *GATES])
    start_together(job, groups=3, nproc=1)
    attempt = job.attempt(2, 0)
    victim = job.worker_pid(2, 0, attempt)
    job.wait_for(
        "the three groups to commit 3 steps together",
        lambda: sum(e["participants"] == 3 for e in job.events("step", group=2, pid=victim, committed=True)) >= 3,
    )
    # The restarted group 2 waits for ``go`` until both survivors are held; only then are their sends gated. A kill
    # inside a step's allreduce can fail the step in one survivor and not the other, which then heals from its peer:
    # a heal that a gate set before the kill would stop halfway.
    go = job.root / "go"
    go.unlink()
    hold_at = max(job.committed_steps(2, 0, victim)) + 15  # read once: the victim commits on meanwhile
    holds = [job.hold_from_step(group, hold_at) for group in (0, 1)]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_held_together(dict(zip((0, 1), holds, strict=True)), since=killed_at)
    sends = [job.root / f"pause.group{group}.heal_send" for group in (0, 1)]
    for gate in sends:
        gate.touch()
    go.touch()
    healer = job.wait_for("torchrun to restart group 2", lambda: job.worker_pid(2, 0, attempt + 1))
    # What the survivors wait for is the heal's start, not the healer's request: one step at a time while it asks.
    job.release_until_healed(
        dict(zip((0, 1), holds, strict=True)),
        2,
        since=killed_at,
        until=lambda: bool(job.events("paused", phase="heal_send")),
    )

    paused = job.wait_for("a survivor to stop halfway through sending its state", lambda: job.events(
        "paused", phase="heal_send"))[0]  # fmt: skip
    source, other = paused["group"], 1 - paused["group"]
    source_attempt = job.attempt(source, 0)
    # Held at a step from which the restarted source can still join: without it the two left could finish first.
    hold = job.hold_from_step(other, paused["step"] + 5)
    source_killed_at = time.time()
    os.kill(paused["pid"], signal.SIGKILL)
    # Only now: a gate removed before the kill lets the source send the rest, and the healer heals from it in full.
    for gate in sends:
        gate.unlink()
    restarted_source = job.wait_for(
        f"torchrun to restart group {source}", lambda: job.worker_pid(source, 0, source_attempt + 1)
    )
    job.wait_for(f"group {source} to ask for its first quorum", lambda: job.events("joining", pid=restarted_source))
    job.release_until_healed({other: hold}, source, since=source_killed_at)
    assert job.wait_exit() == 0, job.tail()

    assert len(job.events("started", group=other)) == 1, f"group {other} must stay up throughout"
    heals = job.events("healed", pid=healer)
    assert len(heals) == 1 and heals[0]["time"] > source_killed_at and heals[0]["step"] > 0, (
        f"group 2 must heal once, from a live peer, after its source died mid-send: {heals}\n{job.tail()}"
    )
    failed = [e for e in job.events("step", pid=healer, committed=False) if e["time"] < heals[0]["time"]]
    assert failed and "error" in failed[0], f"the half-received state must fail the healer's step\n{job.tail()}"
    source_heals = job.events("healed", pid=job.worker_pid(source, 0))
    assert source_heals and source_heals[0]["step"] > 0, f"group {source} never healed after its restart"
    states = job.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=3)
    record("SIGKILL of the heal source halfway through sending", job, failed_at=source_killed_at, victim=source,
           survivors=[other])  # fmt: skip


def test_a_torchrun_agent_killed_its_workers_stop_within_a_bound_and_the_other_group_goes_on(launch):
    """SIGKILL of one group's torchrun agent: none of its own shutdown runs, so nothing of torchrun stops its workers.
    They get SIGTERM as their agent dies, say so in the event log and exit within their SIGTERM grace; they do not
    train on as a group that nobody supervises. The other group commits on alone."""
    job = launch(groups=2, nproc_per_group=2, worker_args=["--max-steps=100000", *GATES])
    start_together(job, groups=2, nproc=2)
    job.wait_for("every group to commit 3 steps", lambda: all(len(job.committed_steps(g)) >= 3 for g in (0, 1)))
    workers = [job.started(1, rank) for rank in (0, 1)]
    orphans = [record["pid"] for record in workers]
    (agent,) = {record["ppid"] for record in workers}
    killed_at, killed_at_wall = time.monotonic(), time.time()  # before the kill: its SIGTERMs come at once
    os.kill(agent, signal.SIGKILL)
    # SIGTERM grace (5 s) plus process exits on a loaded machine
    job.assert_gone_within(orphans, since=killed_at, bound_s=60, after="their torchrun agent died")
    told = {record["rank"] for record in job.events("sigterm", group=1) if record["time"] > killed_at_wall}
    assert told == {0, 1}, f"group 1's workers that said why they stop: {told}"

    def commits_alone() -> int:
        steps = job.events("step", group=0, committed=True, participants=1)
        return sum(1 for step in steps if step["time"] > killed_at_wall)

    job.wait_for("group 0 to commit 3 steps on its own after the kill", lambda: commits_alone() >= 3)


def test_the_launcher_hosting_the_lighthouse_killed_every_group_stops_within_a_bound(launch):
    """SIGKILL of ``lightning-ft launch``, which hosts the lighthouse and relays the groups' output: no ``finally`` of
    it runs. Each torchrun agent gets SIGTERM as its parent dies and stops its workers, which say so in the event log
    and exit within their SIGTERM grace: nothing trains on, unseen, against a lighthouse that is gone."""
    job = launch(groups=2, nproc_per_group=2, worker_args=["--max-steps=100000", *GATES])
    start_together(job, groups=2, nproc=2)
    job.wait_for("every group to commit 3 steps", lambda: all(len(job.committed_steps(g)) >= 3 for g in (0, 1)))
    workers = [job.started(group, rank) for group in (0, 1) for rank in (0, 1)]
    started = [record["pid"] for record in workers] + sorted({record["ppid"] for record in workers})
    assert len(started) == 6  # four workers, two torchrun agents
    os.kill(job.process.pid, signal.SIGKILL)
    job.process.wait(timeout=10)
    killed_at = time.monotonic()
    # SIGTERM grace (5 s) plus process exits on a loaded machine; torchrun's own grace is 30 s
    job.assert_gone_within(started, since=killed_at, bound_s=60, after="the launcher died")
    told = {(record["group"], record["rank"]) for record in job.events("sigterm")}
    assert told == {(group, rank) for group in (0, 1) for rank in (0, 1)}, f"workers that said why they stop: {told}"

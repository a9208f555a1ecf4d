"""Exactly-once data (``FTStrategy(data_mode="exactly_once")``) with real processes, real kills and a late join,
against the default sharded (lossy) mode under the same membership changes.

One schedule for both modes: groups 0 and 1 start (of 3 configured); group 1 is SIGKILLed and restarted by torchrun;
group 2 joins late through a second ``lightning-ft launch --group-ids 2``; group 0 is SIGKILLed and restarted. Every
process records the sample ids of each batch before its gradient can leave the process (``trained`` events) and the
vote's outcome at the end of the batch (``batch`` events, see ``tests/support/workers/train_worker.py``). A
contribution counts when the step it belongs to (its vote step and quorum id) was committed by any group: an allreduce
completes only with every participant's gradient, so a group killed after sending its gradient has still contributed to
a step its peers committed.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from harness import LaunchedJob, assert_bit_identical, launch_job
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart, start_together

from lightning_ft.data.placement import epoch_permutation

pytestmark = [pytest.mark.multiprocess]

SAMPLES = 1024  # 64 batches of 16: a run crosses a few epoch boundaries
BATCH = 16
MAX_STEPS = 100


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def committed_contributions(job: LaunchedJob) -> list[dict[str, Any]]:
    """Every ``trained`` record of a contributing group whose step was committed; for a step attempted twice under the
    same quorum (a vote that failed), a group's last attempt."""
    committed = {(e["vote_step"], e["quorum_id"]) for e in job.events("batch", committed=True)}
    last: dict[tuple[int, int, int, Any], dict[str, Any]] = {}
    for record in job.events("trained"):
        key = (record["vote_step"], record["quorum_id"])
        if record["replica_rank"] is not None and key in committed:
            last[(record["group"], record["pid"], *key)] = record
    return list(last.values())


def commits_with(job: LaunchedJob, group: int, participants: int, after: float = 0.0) -> int:
    return len(
        [
            e
            for e in job.events("step", group=group, committed=True)
            if e["participants"] == participants and e["time"] > after
        ]
    )


def commits_since(job: LaunchedJob, group: int, since: float) -> int:
    return len([e for e in job.events("step", group=group, committed=True) if e["time"] > since])


def pause(root: Path, *groups: int) -> None:
    for group in groups:
        (root / f"pause.group{group}").touch()


def resume(root: Path, *groups: int) -> None:
    for group in groups:
        (root / f"pause.group{group}").unlink()


def run_membership_changes(root: Path, data_mode: str) -> list[dict[str, Any]]:
    """Run the schedule above; returns the committed contributions. Asserts the run itself went as planned."""
    port = free_port()
    worker_args = [
        f"--max-steps={MAX_STEPS}",
        f"--index-data={SAMPLES}",
        f"--batch-size={BATCH}",
        f"--data-mode={data_mode}",
        "--async-quorum=0",
        *GATES,
    ]
    first = launch_job(
        root,
        groups=3,
        worker_args=worker_args,
        # --start-timeout=0: the job starts with groups 0 and 1 instead of waiting for group 2.
        launcher_args=[f"--lighthouse-bind=127.0.0.1:{port}", "--group-ids=0,1", "--start-timeout=0"],
        log_name="first.log",
    )
    late: LaunchedJob | None = None
    try:
        first.wait_for("groups 0 and 1 to start", lambda: first.worker_pid(0, 0) and first.worker_pid(1, 0))
        (root / "go").touch()
        killed_at = kill_and_restart(first, victim=1, rank=0, survivor=0)
        # After the kill: the 2-participant commits before it must not count, or groups 0 and 1 are paused below
        # before they rejoined, and the restarted group 1 and the late group 2, both at step 0, could make a quorum
        # of their own once the lighthouse's join timeout has passed (torchft lets fresh groups start a lineage
        # while a paused group with state heartbeats; the next quorum with that group heals them back onto it).
        first.wait_for(
            "group 0 to commit 3 steps with the restarted group 1",
            lambda: commits_with(first, 0, 2, after=killed_at) >= 3,
        )
        pause(root, 0, 1)  # until the late group asks for its first quorum, so that it joins before they finish
        late = launch_job(
            root,
            groups=3,
            worker_args=worker_args,
            launcher_args=[f"--lighthouse=http://127.0.0.1:{port}", "--group-ids=2"],
            log_name="late.log",
        )
        late.wait_for("group 2 to ask for its first quorum", lambda: late.events("joining", group=2))
        resume(root, 0, 1)
        late.wait_for("group 2 to commit 3 steps with groups 0 and 1", lambda: commits_with(late, 2, 3) >= 3)

        attempt = first.attempt(0, 0)  # not necessarily 0: an attempt may have failed to start (a port taken)
        victim_pid = first.worker_pid(0, 0, attempt)
        # Held before the kill, a few steps on: the survivors commit without group 0, then wait (heartbeating) until
        # the restarted group 0 asks for a quorum, so that they cannot finish the job before it is back.
        hold_at = max(max(first.committed_steps(group)) for group in (1, 2)) + 5
        holds = [first.hold_from_step(group, hold_at) for group in (1, 2)]
        killed_at = time.time()
        os.kill(victim_pid, signal.SIGKILL)
        first.wait_held_together(dict(zip((1, 2), holds, strict=True)), since=killed_at)
        restarted = first.wait_for("torchrun to restart group 0", lambda: first.worker_pid(0, 0, attempt + 1))
        first.wait_for("group 0 to ask for its first quorum again", lambda: first.events("joining", pid=restarted))
        for hold in holds:
            hold.unlink()

        assert first.wait_exit() == 0, first.tail()
        assert late.wait_exit() == 0, late.tail()
    finally:
        first.stop()
        if late is not None:
            late.stop()

    states = first.final_states()
    assert sorted(states) == [(0, 0), (1, 0), (2, 0)], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == MAX_STEPS and state["manager_step"] == MAX_STEPS, (key, state["global_step"])
    assert_bit_identical(states, replicas=3)
    for group in (0, 1):  # both killed groups came back through a heal from a live peer
        assert [e for e in first.events("healed", group=group) if e["step"] > 0], first.tail()
    return committed_contributions(first)


def multiset_difference(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """(in ``a`` more often than in ``b``, in ``b`` more often than in ``a``), each sorted."""
    count_a, count_b = collections.Counter(a), collections.Counter(b)
    return sorted((count_a - count_b).elements()), sorted((count_b - count_a).elements())


def assert_exactly_once(contributions: list[dict[str, Any]], group_size: int = 1) -> None:
    """The committed contributions read a prefix of the permutation stream: each epoch's permutation once, in order
    of the group batches, with no gap and no repeat."""
    trained = [i for record in contributions for i in record["ids"]]
    full_epochs, rest = divmod(len(trained), SAMPLES)
    expected = [i for e in range(full_epochs) for i in epoch_permutation(SAMPLES, e).tolist()]
    expected += epoch_permutation(SAMPLES, full_epochs)[:rest].tolist()
    extra, missing = multiset_difference(trained, expected)
    assert not extra and not missing, f"trained twice or outside the prefix: {extra[:20]}; skipped: {missing[:20]}"
    assert full_epochs >= 1, f"the run should cross an epoch boundary; it trained {len(trained)} samples"

    # Epoch by epoch, from where each group batch lies in the stream: no repeats, and the samples the permutation
    # has at those places, rank by rank.
    group_batch_size = BATCH * group_size
    batches_per_epoch = SAMPLES // group_batch_size
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for record in contributions:
        group_batch = record["cursor"] + record["replica_rank"]
        epoch, position = divmod(group_batch, batches_per_epoch)
        start = position * group_batch_size + record["rank"] * BATCH
        assert record["ids"] == epoch_permutation(SAMPLES, epoch)[start : start + BATCH].tolist(), record
        by_epoch[epoch].extend(record["ids"])
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} trained a sample twice"
    # Group batches were consumed with no gap: every committed step took the next `participants` of them.
    for rank in range(group_size):
        consumed = sorted(r["cursor"] + r["replica_rank"] for r in contributions if r["rank"] == rank)
        assert consumed == list(range(len(consumed))), f"rank {rank}: a group batch was skipped or consumed twice"


@pytest.mark.timeout(420)
def test_exactly_once_data_reads_a_prefix_of_the_permutation_through_kills_and_a_late_join(tmp_path):
    assert_exactly_once(run_membership_changes(tmp_path / "job", "exactly_once"))


@pytest.mark.paths  # make test: groups of one process; HSDP's groups of two in tests/hsdp
@pytest.mark.timeout(300)
def test_exactly_once_data_in_groups_of_two_processes(launch):
    """2 groups × 2 processes: each rank reads its half of its group's batch; a killed rank takes its group down,
    torchrun restarts it, and it heals and reads on where the committed state says."""
    job = launch(
        groups=2,
        nproc_per_group=2,
        worker_args=[
            f"--max-steps={MAX_STEPS}",
            f"--index-data={SAMPLES}",
            f"--batch-size={BATCH}",
            "--data-mode=exactly_once",
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=2)
    kill_and_restart(job, victim=1, rank=1, survivor=0, nproc=2)
    assert_outcome(job, restarted=1, max_steps=MAX_STEPS, replicas=4)
    assert_exactly_once(committed_contributions(job), group_size=2)


@pytest.mark.control
@pytest.mark.timeout(420)
def test_the_default_sharded_mode_skips_samples_under_the_same_membership_changes(tmp_path):
    """torchft documents its sampler as lossy; this shows it. While a group is dead or not yet there, nobody reads
    its shard, and a group that heals continues its shard from its peer's batch index. The control run of the
    exactly-once test above: its scenario does lose samples without exactly-once data (``make test-extra``)."""
    contributions = run_membership_changes(tmp_path / "job", "sharded")

    first_epoch = [i for record in contributions if record["epoch"] == 0 for i in record["ids"]]
    assert max(record["epoch"] for record in contributions) >= 1, "the run should finish its first epoch"
    skipped = SAMPLES - len(set(first_epoch))
    assert skipped > 0, "the sharded mode trained every sample of the first epoch despite the membership changes"


@pytest.mark.timeout(300)
def test_exactly_once_data_with_a_hot_spare_taking_a_dead_groups_place(launch):
    """3 groups, ``min_replica_size=2``, ``world_size_mode="fixed_with_spares"``: the spare's batches are not part of
    any step; when an active group dies the spare reads in its place, and every committed step reads exactly two
    group batches."""
    job = launch(
        groups=3,
        worker_args=[
            f"--max-steps={MAX_STEPS}",
            f"--index-data={SAMPLES}",
            f"--batch-size={BATCH}",
            "--data-mode=exactly_once",
            "--min-replica-size=2",
            "--world-size-mode=fixed_with_spares",
            *GATES,
        ],
    )
    start_together(job, groups=3, nproc=1)
    job.wait_for("every group to commit 3 steps", lambda: all(len(job.committed_steps(g)) >= 3 for g in range(3)))
    latest_roles = {g: [e["replica_rank"] for e in job.events("quorum", group=g)][-1] for g in range(3)}
    (spare,) = [g for g, rank in latest_roles.items() if rank is None]
    victim = max(g for g in range(3) if g != spare)
    others = [g for g in range(3) if g != victim]
    attempt = job.attempt(victim, 0)
    killed_at = time.time()
    os.kill(job.worker_pid(victim, 0, attempt), signal.SIGKILL)
    job.wait_for("the others to commit 3 steps after the kill", lambda: commits_since(job, others[0], killed_at) >= 3)
    pause(job.root, *others)
    restarted = job.wait_for(f"torchrun to restart group {victim}", lambda: job.worker_pid(victim, 0, attempt + 1))
    job.wait_for(f"group {victim} to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    resume(job.root, *others)
    assert job.wait_exit() == 0, job.tail()

    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0), (2, 0)], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == MAX_STEPS and state["manager_step"] == MAX_STEPS, (key, state["global_step"])
    assert_bit_identical(states, replicas=3)
    contributions = committed_contributions(job)
    assert len(contributions) == 2 * MAX_STEPS  # two contributing groups in every committed step
    assert_exactly_once(contributions)


# In `make test-extra` (`make test` stays under 20 minutes): the kills-and-late-join case above runs in `make test`.
@pytest.mark.paths
@pytest.mark.timeout(420)
def test_exactly_once_data_resumed_with_fewer_and_more_groups_reads_on_where_the_checkpoint_left_off(launch, tmp_path):
    """A 2-group job commits 24 steps (48 group batches) and stops, its checkpoint at step 24. From that file alone, a
    1-group and a 3-group job each resume to step 44. The first job's committed samples and each resumed job's
    together are a prefix of the permutation stream, crossing the epoch boundary: the resume neither skips nor repeats
    a sample, whatever the number of groups (the stream's position is torchft's ``batches_committed``, which the
    checkpoint holds, not a per-group shard)."""
    data = [f"--index-data={SAMPLES}", f"--batch-size={BATCH}", "--data-mode=exactly_once", "--ckpt-every=12", *GATES]
    first = launch("first", groups=2, worker_args=["--max-steps=24", f"--ckpt-dir={tmp_path / 'first_ckpts'}", *data])
    start_together(first, groups=2, nproc=1)
    assert first.wait_exit() == 0, first.tail()
    before = committed_contributions(first)
    assert len(before) == 2 * 24, len(before)

    resumed = {}
    for groups in (1, 3):
        ckpt_dir = tmp_path / f"resume_{groups}_ckpts"
        ckpt_dir.mkdir()
        (ckpt_dir / "last.ckpt").write_bytes((tmp_path / "first_ckpts" / "last.ckpt").read_bytes())
        resumed[groups] = launch(
            f"resume_{groups}",
            groups=groups,
            worker_args=["--max-steps=44", f"--ckpt-dir={ckpt_dir}", "--resume", *data],
        )
    for groups, job in resumed.items():
        start_together(job, groups=groups, nproc=1)
    for groups, job in resumed.items():
        assert job.wait_exit() == 0, job.tail()
        assert not job.events("healed"), f"{groups} groups resumed from one checkpoint must not need healing"
        states = job.final_states()
        assert sorted(states) == [(g, 0) for g in range(groups)], sorted(states)
        for key, state in states.items():
            assert state["global_step"] == state["manager_step"] == 44, (groups, key, state["global_step"])
        assert_bit_identical(states, replicas=groups)
        after = committed_contributions(job)
        assert len(after) == groups * 20, (groups, len(after))
        assert min(record["cursor"] for record in after) == 48, f"{groups} groups did not read on at group batch 48"
        assert_exactly_once(before + after)

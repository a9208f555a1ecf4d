"""Each group's data position through real failures: real lighthouse, torchrun restarts, SIGKILL by PID.

The workers train on samples that carry their index (``--index-data``) and emit one ``batch`` event per batch:
the committed step after it, the loop position (epoch, batch index) and the sample ids. What each group must read
is computed here independently, with the sampler Lightning installs: ``DistributedSampler(seed=0)`` over
``groups × 1`` ranks, one rank per group.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from matrix import write
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart, start_together
from torch.utils.data import DistributedSampler

from lightning_ft.data.sidecars import sidecar_path

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

BATCH = 16  # the worker's default --batch-size
STATEFUL_GROUP = 1  # the resume test's group that reads through StatefulDataLoader; the other one, a plain DataLoader


def shard(size: int, group: int, epoch: int, groups: int = 2) -> list[list[int]]:
    """Group ``group``'s batches of sample ids in ``epoch``."""
    sampler = DistributedSampler(range(size), num_replicas=groups, rank=group, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[start : start + BATCH] for start in range(0, len(ids), BATCH)]


def batches(job: LaunchedJob, pid: int) -> list[dict[str, Any]]:
    return job.events("batch", pid=pid)


def attempts(job: LaunchedJob, group: int) -> list[int]:
    """The worker PIDs of ``group``'s rank 0, oldest attempt first."""
    return [record["pid"] for record in sorted(job.events("started", group=group, rank=0), key=lambda r: r["attempt"])]


def assert_reads_its_own_shard(size: int, group: int, records: list[dict[str, Any]]) -> None:
    for record in records:
        expected = shard(size, group, record["epoch"])[record["batch_idx"]]
        assert record["ids"] == expected, f"group {group} at step {record['step']}: {record} != {expected}"


@pytest.mark.parametrize(
    ("async_quorum", "transport", "size"),
    [
        # 100 batches per epoch: the whole run is epoch 0, so the healed group continues the epoch it died in
        pytest.param(1, "http", 3200, id="async-http-same-epoch"),
        # 3 batches per epoch: at the heal its peer is epochs ahead of the restarted group's fresh epoch 0
        pytest.param(0, "pg", 96, id="sync-pg-later-epoch", marks=pytest.mark.paths),
    ],
)
def test_a_healed_group_continues_its_own_shard_at_its_peers_batch_index(launch, async_quorum, transport, size):
    """2 groups × 1 process. Group 1 is SIGKILLed mid-epoch, restarted by torchrun, and heals from group 0.

    The restarted process's first batch is the one it had loaded when the heal came: its own first batch of epoch 0
    (trained on with synchronous quorum, sat out with asynchronous quorum). From the heal on it is at its peer's
    (epoch, batch index) at every step, and every later batch is the batch at that index of *its own* shard in that
    epoch: so it never re-reads a sample it had read in that epoch before it died, and it skips the batches of the
    steps it was dead for (its peer trained those steps alone).
    """
    max_steps = 60
    job = launch(
        groups=2,
        worker_args=[
            f"--max-steps={max_steps}",
            f"--async-quorum={async_quorum}",
            f"--transport={transport}",
            f"--index-data={size}",
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=1)
    # A step's ``batch`` event comes after its ``step`` event: wait for the batches, so that the kill (which follows
    # three committed steps) cannot land between a step and its batch event and leave fewer than three batches.
    first = job.worker_pid(1, 0)
    job.wait_for("group 1 to record 3 batches", lambda: len(batches(job, first)) >= 3)
    kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)  # bit-identical replicas, exact step count

    *_, killed, restarted = attempts(job, group=1)
    survivor = job.worker_pid(0, 0)
    before_death, after_restart, peer = batches(job, killed), batches(job, restarted), batches(job, survivor)
    in_flight, *after_heal = after_restart

    assert in_flight["ids"] == shard(size, 1, epoch=0)[0], "the batch in flight at the heal is its own first batch"
    healed_at = in_flight["step"]
    assert [record["step"] for record in after_restart] == list(range(healed_at, max_steps + 1))
    peer_position = {
        record["step"]: (record["epoch"], record["batch_idx"]) for record in peer if record["step"] >= healed_at
    }
    for record in after_restart:
        assert (record["epoch"], record["batch_idx"]) == peer_position[record["step"]], f"misaligned: {record}"
    assert_reads_its_own_shard(size, 1, after_heal)
    assert_reads_its_own_shard(size, 0, peer)
    assert_reads_its_own_shard(size, 1, before_death)

    for epoch in {record["epoch"] for record in after_heal}:
        read_before = {i for record in before_death if record["epoch"] == epoch for i in record["ids"]}
        read_again = read_before & {i for record in after_heal if record["epoch"] == epoch for i in record["ids"]}
        assert not read_again, f"epoch {epoch}: samples read before the kill and again after the heal: {read_again}"

    (repositioned,) = job.events("data_repositioned", pid=restarted)
    if size == 3200:
        assert {record["epoch"] for record in before_death + after_restart} == {0}
        assert repositioned["how"] == "forward"
        assert len(before_death) >= 3 and after_heal[0]["batch_idx"] > before_death[-1]["batch_idx"] + 1
    else:
        assert in_flight["epoch"] > 0
        # a new iterator in the peer's epoch, or none needed when the peer's epoch ends with the healing batch
        assert repositioned["how"] in ("restart", "epoch_end")


def saved_step(path: Path) -> int | None:
    try:
        return torch.load(path, weights_only=False)["global_step"]
    except FileNotFoundError:
        return None


def kill_every_group(job: LaunchedJob, ckpt_dir: Path) -> int:
    """SIGKILL every group once each has saved its own data position of the same ``last.ckpt``; return its step.

    The writer (group 0) is stopped at the start of a batch, after all its saves, so ``last.ckpt`` no longer
    changes; group 1 cannot finish a step without it, so its last save is that same checkpoint, done when its
    sidecar says so. Each worker's torchrun agent is killed first, so that nothing restarts the worker.
    """
    (job.root / "pause.group0.batch_start").touch()
    writer = job.worker_pid(0, 0)
    job.wait_for("group 0 to stop", lambda: job.events("paused", pid=writer, phase="batch_start"))
    step = saved_step(ckpt_dir / "last.ckpt")
    own_position = Path(sidecar_path(ckpt_dir / "last.ckpt", replica_group_id=1, group_rank=0))
    job.wait_for(f"group 1 to save its data position at step {step}", lambda: saved_step(own_position) == step)
    for group in (0, 1):
        worker = job.started(group, 0)
        os.kill(worker["ppid"], signal.SIGKILL)
        os.kill(worker["pid"], signal.SIGKILL)
    assert job.wait_exit() == 1  # the launcher reports the groups as failed
    assert step is not None
    return step


def test_every_group_resumes_its_own_shard_from_the_last_checkpoint(launch, tmp_path):
    """2 groups × 1 process, every group killed, the job resumed with ``ckpt_path="last"``.

    7 batches per epoch, checkpoints every 10 steps: every checkpoint falls mid-epoch, in epoch 1 or later. Steps
    1..S of the first job and S+1..60 of the resumed one read, together, each group's shard batch after batch in
    order: nothing is read twice and nothing is skipped. Group 1 reads through ``StatefulDataLoader`` and restores its
    own loader state from its sidecar (the worker's dataset refuses another group's); group 0 reads through a plain
    ``DataLoader`` and counts its way there. Both kinds in one job: each group's data position is its own.
    """
    ckpt_dir = tmp_path / "checkpoints"
    size, max_steps, per_epoch = 2 * BATCH * 7, 60, 7
    common = [
        f"--max-steps={max_steps}",
        f"--ckpt-dir={ckpt_dir}",
        "--ckpt-every=10",
        f"--index-data={size}",
        f"--stateful-loader={STATEFUL_GROUP}",
        *GATES,
    ]
    first = launch("first", groups=2, worker_args=common)
    start_together(first, groups=2, nproc=1)
    first.wait_for(
        "last.ckpt at step 20",
        lambda: [r for r in first.events("checkpoint_saved") if r["path"].endswith("last.ckpt") and r["step"] >= 20],
    )
    first_pids = {group: first.worker_pid(group, 0) for group in (0, 1)}
    killed_at = time.time()
    last_step = kill_every_group(first, ckpt_dir)
    assert last_step % 10 == 0 and last_step % per_epoch != 0

    resumed = launch("resumed", groups=2, worker_args=[*common, "--resume"])
    start_together(resumed, groups=2, nproc=1)
    assert resumed.wait_exit() == 0, resumed.tail()

    for group in (0, 1):
        pid = resumed.worker_pid(group, 0)
        (restored,) = resumed.events("data_position_restored", pid=pid)
        assert restored["source"] == ("loader_state" if group == STATEFUL_GROUP else "counting"), (group, restored)
        before = [record for record in batches(first, first_pids[group]) if record["step"] <= last_step]
        after = batches(resumed, pid)
        assert [record["step"] for record in before] == list(range(1, last_step + 1))
        assert [record["step"] for record in after] == list(range(last_step + 1, max_steps + 1))
        for record in before + after:
            assert (record["epoch"], record["batch_idx"]) == divmod(record["step"] - 1, per_epoch), record
        assert_reads_its_own_shard(size, group, before + after)
    loaded = {(record["group"], record["replica_group"]) for record in resumed.events("loader_state_loaded")}
    assert loaded == {(STATEFUL_GROUP, STATEFUL_GROUP)}, loaded
    assert not resumed.events("healed"), "groups resumed from the same checkpoint must not need healing"
    states = resumed.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=2)
    resumed_at = min(e["time"] for e in resumed.events("step", committed=True))
    reached = max(max(first.committed_steps(group)) for group in (0, 1))
    write(
        {
            "case": "Kill of the whole job, resume from last.ckpt (every 10 steps)",
            "identical": True,
            "steps_lost": reached - last_step,
            "first_commit_after_relaunch_s": round(resumed_at - killed_at, 2),
        }
    )

"""One job, one model: groups that start apart, restart late, come back after the end, or all die at once never fork
the job or overwrite its checkpoints (lightning_ft.start.decision, lightning_ft.start.record).

Real launcher, lighthouse and torchrun restarts; SIGKILL by PID. A group is held before it builds its Trainer by the
worker's ``hold_start.group<G>`` file (it leaves ``held_start.group<G>.attempt<A>`` to say it is held there).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from harness import assert_tree_equal, process_gone
from test_fault_tolerance import GATES, start_together

from lightning_ft_job.events import ENV_RUN_ID

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def held_at_start(root: Path, group: int, attempt: int) -> bool:
    return (root / f"held_start.group{group}.attempt{attempt}").exists()


def assert_identical_replicas(states: dict, count: int, max_steps: int) -> None:
    assert len(states) == count, f"expected {count} final states, got {sorted(states)}"
    (first_key, first), *others = sorted(states.items())
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    for key, state in others:
        assert_tree_equal(first, state, f"{first_key} vs {key}")


def checkpoint_files(directory: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in sorted(directory.glob("*.ckpt"))}


def test_groups_that_start_apart_wait_for_each_other_and_end_identical(launch, tmp_path):
    max_steps = 30
    root = tmp_path / "job"
    root.mkdir()
    (root / "go").touch()  # the worker's own start gate stays open: the strategy's wait is under test
    hold = root / "hold_start.group1"
    hold.touch()
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", *GATES])
    waiting = job.wait_for("group 0 to wait for group 1", lambda: job.events("waiting_for_groups", group=0))
    assert waiting[0]["missing"] == [1]
    job.wait_for("group 1 to be held at its start", lambda: held_at_start(root, 1, 0))
    # Longer than the job takes alone (about 2 s here): without the wait, group 0 would have trained to the end.
    job.wait_for("group 0 to have waited 8 s", lambda: time.time() - waiting[0]["time"] > 8, timeout=60)
    assert not job.events("step"), "a group trained while another had not started"
    hold.unlink()
    assert job.wait_exit() == 0, job.tail()

    assert job.events("groups_joined", group=0)
    for group in (0, 1):
        steps = job.events("step", group=group, committed=True)
        # What the start wait guarantees: the job's first step is taken by both groups together. Later steps may
        # lose a participant to a starved heartbeat on a busy machine (it heals back); that is not under test.
        assert steps[0]["step"] == 1 and steps[0]["participants"] == 2, f"group {group} started alone: {steps[0]}"
        assert steps[-1]["step"] == max_steps, group
    # The job committed every step once: the groups' commits together are exactly 1..max_steps, none lost or doubled.
    together = sorted({e["step"] for e in job.events("step", committed=True)})
    assert together == list(range(1, max_steps + 1))
    assert not job.events("start_timeout_expired")
    assert_identical_replicas(job.final_states(), count=2, max_steps=max_steps)


def test_a_start_timeout_shorter_than_the_gap_starts_alone_warns_and_the_late_group_heals(launch, tmp_path):
    max_steps = 40
    root = tmp_path / "job"
    root.mkdir()
    (root / "go").touch()
    hold = root / "hold_start.group1"
    hold.touch()
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--start-timeout=1", *GATES])
    alone = job.hold_from_step(0, 10)  # group 0 stops at step 10 until group 1 asks to join
    expired = job.wait_for("group 0's start timeout", lambda: job.events("start_timeout_expired", group=0))
    assert expired[0]["missing"] == [1]
    job.wait_for("group 0 to train alone to step 10", lambda: job.events("paused", group=0, phase="from_step"))
    hold.unlink()
    joiner = job.wait_for("group 1 to start", lambda: job.worker_pid(1, 0))
    job.wait_for("group 1 to ask for its first quorum", lambda: job.events("joining", group=1, pid=joiner))
    alone.unlink()
    assert job.wait_exit() == 0, job.tail()

    assert "did not start within start_timeout=1s" in job.log_path.read_text()
    assert len(job.events("start_timeout_expired")) == 1  # one warning, by the group that started alone
    assert not job.events("waiting_for_groups", group=1), "a group joining a job under way must not wait"
    assert job.events("healed", group=1), "the late group did not heal from its live peer"
    assert job.committed_steps(0) == list(range(1, max_steps + 1))
    assert all(e["participants"] == 1 for e in job.events("step", group=0, committed=True) if e["step"] <= 10)
    assert_identical_replicas(job.final_states(), count=2, max_steps=max_steps)


def test_a_group_restarted_after_the_end_exits_without_touching_the_checkpoints(launch, tmp_path):
    """Group 1 is SIGKILLed two steps before max_steps; torchrun restarts it only after group 0 has finished (the
    launcher's finish grace is far longer, so the mechanism is tested, not the backstop). Then a second launcher
    starts group 1 once more as part of the same run (``LIGHTNING_FT_RUN_ID``, as a requeued scheduler job keeps its
    id): it reads the run's end from the record in the checkpoint folder."""
    max_steps = 30
    ckpt_dir = tmp_path / "checkpoints"
    common = [f"--max-steps={max_steps}", f"--ckpt-dir={ckpt_dir}", "--ckpt-every=5"]
    job = launch(groups=2, worker_args=[*common, *GATES], launcher_args=["--finish-grace=600"])
    root = job.root
    start_together(job, groups=2, nproc=1)
    held = job.hold_from_step(1, max_steps - 2)
    job.wait_for("group 1 to stop two steps before the end", lambda: job.events("paused", group=1, phase="from_step"))
    victim = job.worker_pid(1, 0)
    (root / "hold_start.group1").touch()
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    held.unlink()
    job.wait_for("torchrun to restart group 1 (held at its start)", lambda: held_at_start(root, 1, 1))
    group0 = job.worker_pid(0, 0)
    job.wait_for("group 0 to finish", lambda: job.events("finished", group=0) and process_gone(group0))
    written = checkpoint_files(ckpt_dir)
    final = job.final_states()
    assert list(final) == [(0, 0)] and final[(0, 0)]["global_step"] == max_steps
    (root / "hold_start.group1").unlink()
    assert job.wait_exit() == 0, job.tail()

    assert job.events("job_already_finished", group=1)
    assert not [e for e in job.events(group=1) if e["time"] > killed_at and e["event"] in ("started", "step")]
    assert not [e for e in job.events("checkpoint_saved") if e["time"] > killed_at and e["group"] == 1]
    assert checkpoint_files(ckpt_dir) == written, "a checkpoint file was written after the job had finished"
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == max_steps
    assert_tree_equal(last["state_dict"], final[(0, 0)]["model"], "last.ckpt vs group 0's final model")

    [finished] = job.events("job_already_finished", group=1)
    again = launch(
        "again", groups=2, worker_args=common, launcher_args=["--group-ids=1"], env={ENV_RUN_ID: finished["run"]}
    )
    assert again.wait_exit(timeout=120) == 0, again.tail()
    assert again.events("job_already_finished", group=1)
    assert not again.events("started") and not again.events("step")
    assert checkpoint_files(ckpt_dir) == written, "a group started after the end wrote a checkpoint"
    assert not list(again.out_dir.glob("final.*")), "a group started after the end trained"


def test_a_restarted_group_with_no_peer_and_no_checkpoints_stops_with_an_error(launch, tmp_path):
    """Group 1 is killed and its restart held at its start; then group 0 is killed too, its restart held likewise: the
    job has not finished, and no group is left to heal from. Released, group 1's restart finds no live peer within
    ``start_timeout`` and no checkpoint: ``NoLivePeerError``, never a job started over from step 0. (A group that
    comes back after its peers *finished* exits 0 instead: ``test_run_end.py``.)"""
    max_steps = 30
    job = launch(
        groups=2,
        worker_args=[f"--max-steps={max_steps}", "--start-timeout=2", *GATES],
        max_restarts=1,
        launcher_args=["--finish-grace=600"],
    )
    root = job.root
    start_together(job, groups=2, nproc=1)
    held = job.hold_from_step(1, 10)
    job.wait_for("group 1 to stop at step 10", lambda: job.events("paused", group=1, phase="from_step"))
    group0_held = job.hold_from_step(0, 14)  # before the kill: group 0 must not finish the job meanwhile
    (root / "hold_start.group1").touch()
    killed_at = time.time()
    os.kill(job.worker_pid(1, 0), signal.SIGKILL)
    held.unlink()
    job.wait_for("torchrun to restart group 1 (held at its start)", lambda: held_at_start(root, 1, 1))
    group0 = job.worker_pid(0, 0)
    job.wait_held_alone(0, since=killed_at)
    (root / "hold_start.group0").touch()
    group0_killed_at = time.time()
    os.kill(group0, signal.SIGKILL)
    group0_held.unlink()
    job.wait_for("torchrun to restart group 0 (held at its start)", lambda: held_at_start(root, 0, 1))
    (root / "hold_start.group1").unlink()
    job.wait_for("group 1's restart to stop for want of a peer", lambda: job.events("no_live_peer", group=1))
    (root / "hold_start.group0").unlink()
    assert job.wait_exit() == 1, job.tail()  # both failed; nothing restarts them (--max-restarts=1)

    errors = job.events("no_live_peer", group=1)
    assert len(errors) == 1 and "found no live replica group within start_timeout=2s" in errors[0]["error"]
    assert "NoLivePeerError" in job.log_path.read_text()
    assert not [e for e in job.events("step", group=1) if e["time"] > killed_at], "group 1 trained alone"
    assert not [e for e in job.events("step", group=0) if e["time"] > group0_killed_at], "group 0 trained alone"
    assert not job.final_states() and not job.events("finished")


def test_every_group_killed_at_once_resumes_from_the_newest_checkpoint(launch, tmp_path):
    max_steps, every = 40, 5
    ckpt_dir = tmp_path / "checkpoints"
    job = launch(
        groups=2,
        worker_args=[f"--max-steps={max_steps}", f"--ckpt-dir={ckpt_dir}", f"--ckpt-every={every}", *GATES],
        max_restarts=3,
    )
    start_together(job, groups=2, nproc=1)
    job.wait_for(
        "a checkpoint at step 10 or later", lambda: [r for r in job.events("checkpoint_saved") if r["step"] >= 10]
    )
    victims = {group: job.worker_pid(group, 0) for group in (0, 1)}
    killed_at = time.time()
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    reached = max(max(job.committed_steps(group, pid=pid)) for group, pid in victims.items())
    assert job.wait_exit() == 0, job.tail()

    saved = [r["step"] for r in job.events("checkpoint_saved") if r["time"] < killed_at]
    resumed_steps = set()
    for group in (0, 1):
        resumed = job.events("resumed_from_checkpoint", group=group)
        assert len(resumed) == 1, f"group {group} said it resumed {len(resumed)} times"
        step = resumed[0]["step"]
        resumed_steps.add(step)
        # The newest checkpoint: the last one reported saved, or one saved just as the kill landed.
        assert step >= max(saved) and step % every == 0 and step >= reached - every, (step, saved, reached)
        # The restarted lifetimes' steps (a victim may still log a step between killed_at and its death).
        after = [e["step"] for e in job.events("step", group=group, committed=True) if e["pid"] != victims[group]]
        assert after == list(range(step + 1, max_steps + 1)), f"group {group} went on from {after[:1]}"
    assert len(resumed_steps) == 1, f"the groups resumed from different steps: {resumed_steps}"
    assert_identical_replicas(job.final_states(), count=2, max_steps=max_steps)

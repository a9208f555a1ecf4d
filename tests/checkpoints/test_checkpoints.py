"""Global checkpoints under fault tolerance: one writer at a time, crash-safe files, and whole-job resume."""

from __future__ import annotations

import csv
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def saves(job: LaunchedJob) -> list[dict]:
    return job.events("checkpoint_saved")


def assert_one_writer_per_save(job: LaunchedJob) -> None:
    writers = Counter((record["path"], record["step"]) for record in saves(job))
    twice = {save: count for save, count in writers.items() if count > 1}
    assert not twice, f"checkpoints written by more than one process: {twice}"


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def manager_state(checkpoint: dict) -> dict:
    return checkpoint["callbacks"]["ManagerCheckpointCallback"]["manager"]


def test_a_writer_killed_while_writing_last_ckpt_leaves_the_previous_file_and_the_next_group_takes_over(
    launch, tmp_path
):
    """Group 0, the writer, is SIGKILLed halfway through writing ``last.ckpt`` (half of the bytes in its temporary
    file). The file on disk is still the previous save, whole. Group 1 carries on and takes over writing while group
    0 is down; the restarted group 0 heals, writes again and sweeps its killed predecessor's temporary file; the job
    ends with one writer per save, both replicas identical and a ``last.ckpt`` at ``max_steps``. Also checks the
    logging rule: only group 0's rank 0 logs, so loggers never share a directory."""
    ckpt_dir, log_dir = tmp_path / "checkpoints", tmp_path / "logs"
    max_steps, every = 50, 5
    job = launch(
        groups=2,
        worker_args=[
            f"--max-steps={max_steps}",
            f"--ckpt-dir={ckpt_dir}",
            f"--ckpt-every={every}",
            f"--csv-logs={log_dir}",
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=1)
    attempt = job.attempt(0, 0)
    writer = job.worker_pid(0, 0, attempt)
    first = job.wait_for(
        "group 0 to write last.ckpt", lambda: [r for r in saves(job) if r["path"].endswith("last.ckpt")]
    )[0]
    gate = job.root / "pause.group0.last_ckpt_write"
    gate.touch()
    paused = job.wait_for("group 0 to stop halfway through writing last.ckpt", lambda: job.events(
        "paused", pid=writer, phase="last_ckpt_write"))[0]  # fmt: skip
    takeover_until = paused["step"] + 2 * every
    assert takeover_until < max_steps, f"group 0 stopped late, at step {paused['step']}"
    # Group 1 is held two steps on: its next save would replace the file the kill must leave alone.
    hold = job.hold_from_step(1, paused["step"] + 2)
    killed_at = time.time()
    os.kill(writer, signal.SIGKILL)
    gate.unlink()
    job.wait_held_alone(1, since=killed_at)

    on_disk = load(ckpt_dir / "last.ckpt")
    previous = max(r["step"] for r in saves(job) if r["path"].endswith("last.ckpt"))
    assert previous < paused["step"] and first["step"] <= previous
    assert on_disk["global_step"] == previous, f"last.ckpt holds step {on_disk['global_step']}, not {previous}"
    assert manager_state(on_disk)["step"] == previous
    partial = Path(paused["path"])
    assert partial.exists() and partial.stat().st_size > 0, "the killed writer's temporary file should be on disk"

    # Then group 1 goes on alone through two saves, which it writes, and stops until group 0 is back.
    moved_at = time.time()
    job.hold_from_step(1, takeover_until)
    job.wait_for(
        "group 1 to take over writing and stop",
        lambda: (
            [r for r in job.events("paused", group=1, phase="from_step") if r["time"] > moved_at]
            and [r for r in saves(job) if r["group"] == 1 and r["time"] > killed_at]
        ),
    )
    restarted = job.wait_for("torchrun to restart group 0", lambda: job.worker_pid(0, 0, attempt + 1))
    job.wait_for("group 0 to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    hold.unlink()
    assert job.wait_exit() == 0, job.tail()

    assert len(job.events("started", group=1)) == 1, "group 1 must stay up throughout"
    assert_one_writer_per_save(job)
    assert all(record["group"] == 0 for record in saves(job) if record["time"] < killed_at)
    assert not list(ckpt_dir.glob("*.partial")) and not list(ckpt_dir.glob(".*.partial")), (
        "a temporary checkpoint file was left behind"
    )
    for path in ckpt_dir.glob("*.ckpt"):
        checkpoint = load(path)  # every file is whole
        assert manager_state(checkpoint)["step"] == checkpoint["global_step"], path.name
    assert_only_group_zero_logged(job, log_dir)
    last = load(ckpt_dir / "last.ckpt")
    assert last["global_step"] == manager_state(last)["step"] == max_steps
    assert len(last["optimizer_states"]) == 1 and len(last["lr_schedulers"]) == 1
    states = job.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=2)


def assert_only_group_zero_logged(job: LaunchedJob, log_dir: Path) -> None:
    loggers = {(record["group"], record["pid"]) for record in job.events("rank_zero") if record["rank_zero"]}
    group_zero_lifetimes = {(0, record["pid"]) for record in job.events("started", group=0)}
    assert loggers == group_zero_lifetimes, f"processes that logged: {loggers}"
    metric_files = sorted(log_dir.rglob("metrics.csv"))
    assert len(metric_files) == len(group_zero_lifetimes), metric_files  # one directory per process lifetime
    for path in metric_files:
        steps = [int(row["step"]) for row in csv.DictReader(path.open()) if row.get("train_loss")]
        assert steps and steps == sorted(set(steps)), f"{path}: steps not written by a single process: {steps}"


def test_resumed_training_equals_the_uninterrupted_run_and_resumes_with_another_number_of_groups(launch, tmp_path):
    """One 2-group job runs 40 steps uninterrupted, keeping a checkpoint every 10. From its step-20 checkpoint alone
    (copied as ``last.ckpt`` into a directory of its own), two jobs resume side by side:

    * 2 groups: steps 21..40 end bit-identical to the uninterrupted run's step 40 (weights, optimizer and scheduler
      state): a resume loses, repeats and changes nothing.
    * 3 groups: every group starts at step 21 from the file, none heals, and the 3 replicas end identical at 40.
    * 1 group (fewer than the job had): it starts at step 21 from the file and ends at 40, alone.
    """
    max_steps, saved_step = 40, 20
    steps = [f"--max-steps={max_steps}", "--ckpt-every=10", *GATES]
    reference = launch("reference", groups=2, worker_args=[*steps, f"--ckpt-dir={tmp_path / 'reference_ckpts'}"])
    start_together(reference, groups=2, nproc=1)
    assert reference.wait_exit() == 0, reference.tail()
    (step_file,) = (tmp_path / "reference_ckpts").glob(f"*step={saved_step}.ckpt")
    saved = load(step_file)
    saved_manager = manager_state(saved)
    assert saved["global_step"] == saved_manager["step"] == saved_step

    resumes = {}
    for groups in (2, 3, 1):
        ckpt_dir = tmp_path / f"resume_{groups}_ckpts"
        ckpt_dir.mkdir()
        (ckpt_dir / "last.ckpt").write_bytes(step_file.read_bytes())
        resumes[groups] = launch(
            f"resume_{groups}", groups=groups, worker_args=[*steps, f"--ckpt-dir={ckpt_dir}", "--resume"]
        )
    for groups, job in resumes.items():
        start_together(job, groups=groups, nproc=1)
    for groups, job in resumes.items():
        assert job.wait_exit() == 0, job.tail()
        for group in range(groups):
            first_step = job.committed_steps(group)[0]
            assert first_step == saved_step + 1, f"{groups} groups: group {group} resumed at {first_step}"
        assert not job.events("healed"), f"{groups} groups resumed from one checkpoint must not need healing"
        states = job.final_states()
        for key, state in states.items():
            assert state["global_step"] == state["manager_step"] == max_steps, (groups, key)
            # every group took part in every step after the resume: the Manager's count went on from the file's
            batches = saved_manager["batches_committed"] + groups * (max_steps - saved_step)
            assert state["batches_committed"] == batches, (groups, key, state["batches_committed"], batches)
        assert_bit_identical(states, replicas=groups)

    uninterrupted = reference.final_states()
    assert_bit_identical(uninterrupted, replicas=2)
    # (-1, 0): the uninterrupted run's group 0, beside the resumed job's two replicas; the checkpoint directories,
    # and so ModelCheckpoint's best path, differ by design
    compared = {(-1, 0): uninterrupted[(0, 0)], **resumes[2].final_states()}
    training = {key: {k: v for k, v in state.items() if k != "best_model_path"} for key, state in compared.items()}
    assert_bit_identical(training, replicas=3)

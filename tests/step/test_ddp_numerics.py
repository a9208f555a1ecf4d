"""The default DDP path computes what single-process training on the global batch computes.

Replicas that agree prove nothing about the average they agree on: a wrong divisor, or a healing group's zeroed
gradient counted as a participant's, leaves every replica identical and wrong. Here every process trains plain SGD
(a step is lr × gradient, so a gradient error shows) on samples that carry their index, and records which samples
each contributing replica trained on at each committed step (``trained`` events). One process then replays the job:
one SGD step per committed step on the union of the contributing replicas' samples, with the same LR schedule. The
replicas must end equal to that replay (up to float summation order) and bit-identical to each other.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from test_exactly_once import committed_contributions
from test_failure_injection import inject
from test_fault_tolerance import GATES, assert_outcome, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SEED, LR, SAMPLES = 7, 0.05, 4096
SGD = ["--optimizer=sgd", f"--lr={LR}", f"--seed={SEED}", f"--index-data={SAMPLES}"]


def replay(job: LaunchedJob, max_steps: int) -> dict[str, torch.Tensor]:
    """The parameters of one process that takes the job's committed steps on the union of their contributions."""
    from workers.train_worker import Regressor, dataset

    by_step: dict[int, list[dict]] = defaultdict(list)
    for record in committed_contributions(job):
        by_step[record["vote_step"]].append(record)
    assert sorted(by_step) == list(range(max_steps)), f"committed steps with contributions: {sorted(by_step)}"
    torch.manual_seed(SEED)
    reference = Regressor(lr=LR, optimizer="sgd")
    optimization = reference.configure_optimizers()  # the worker's own optimizer and step-interval schedule
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    data = dataset(SAMPLES)
    for step in range(max_steps):
        contributions = by_step[step]
        assert len({record["quorum_id"] for record in contributions}) == 1, contributions
        ids = [i for record in sorted(contributions, key=lambda r: (r["group"], r["rank"])) for i in record["ids"]]
        x, y = data[ids]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference.net(x), y).backward()
        optimizer.step()
        scheduler.step()
    return {name: tensor for name, tensor in reference.state_dict().items() if name.startswith("net.")}


def assert_equal_to_replay(job: LaunchedJob, max_steps: int) -> None:
    expected = replay(job, max_steps)
    for key, state in job.final_states().items():
        for name, tensor in expected.items():
            torch.testing.assert_close(
                state["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, k=key, n=name: f"{k} {n}: {m}"
            )


def test_two_groups_of_two_processes_step_as_one_process_on_the_global_batch(launch):
    """2 groups × 2 processes: DDP averages inside each group, the Manager across groups; three committed steps
    equal three single-process steps on the 64 samples of the four processes."""
    steps = 3
    job = launch(groups=2, nproc_per_group=2, worker_args=[f"--max-steps={steps}", *SGD, *GATES])
    start_together(job, groups=2, nproc=2)
    assert job.wait_exit() == 0, job.tail()
    contributions = committed_contributions(job)
    assert len(contributions) == 4 * steps, "every rank of both groups contributes to every step"
    states = job.final_states()
    assert sorted(states) == [(g, r) for g in (0, 1) for r in (0, 1)]
    assert_bit_identical(states, replicas=4)  # every rank of both groups holds one model, bit for bit
    assert_equal_to_replay(job, steps)


def test_a_step_with_a_healing_group_is_averaged_over_the_participants_only(launch):
    """2 groups × 1 process, asynchronous quorum. Group 1 is SIGKILLed between two batches and restarted; group 0
    commits alone meanwhile; the restarted group trains its first batch while it heals inside the vote and sits that
    step out (its gradient is zeroed). Every committed step must be the average over the groups that took part in
    it: 2, then 1 alone, then 1 beside a healing group, then 2 again."""
    max_steps = 30
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--async-quorum=1", *SGD, *GATES])
    start_together(job, groups=2, nproc=1)
    attempt = job.attempt(1, 0)
    victim = job.worker_pid(1, 0, attempt)
    job.wait_for(
        "group 1 to commit 3 steps with its peer",
        lambda: sum(e["participants"] == 2 for e in job.events("step", group=1, pid=victim, committed=True)) >= 3,
    )
    # Stopped between two batches, so every contribution it made is recorded before the kill.
    pause = job.root / "pause.group1.rank0"
    pause.touch()
    job.wait_for("group 1 to stop between batches", lambda: job.events("paused", pid=victim))
    hold = job.hold_from_step(0, max(job.committed_steps(0)) + 8)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    pause.unlink()
    job.wait_held_alone(0, since=killed_at)
    restarted = job.wait_for("torchrun to restart group 1", lambda: job.worker_pid(1, 0, attempt + 1))
    job.wait_for("group 1 to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    job.release_until_healed({0: hold}, 1, since=killed_at)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)

    healing = job.events("trained", pid=restarted)[0]
    assert healing["replica_rank"] is None and healing["participants"] == 1, "the healing step: group 0 alone"
    steps_of_group0 = job.events("step", group=0, committed=True)
    assert {e["participants"] for e in steps_of_group0} == {1, 2}
    assert_equal_to_replay(job, max_steps)


def replay_with_buffers(job: LaunchedJob, max_steps: int) -> tuple[dict[str, torch.Tensor], dict]:
    """One process replaying the job's committed steps on a BatchNorm model with AdamW and a step-interval schedule:
    for each step, every contributing group's forward pass on its own samples (its own batch statistics, from the
    committed running statistics), the mean of their losses, one optimizer step; the running statistics become the
    committed ones plus the mean of the groups' changes. Returns the model state and the optimizer state."""
    from workers.train_worker import Regressor, dataset

    by_step: dict[int, list[dict]] = defaultdict(list)
    for record in committed_contributions(job):
        by_step[record["vote_step"]].append(record)
    assert sorted(by_step) == list(range(max_steps)), f"committed steps with contributions: {sorted(by_step)}"
    torch.manual_seed(SEED)
    reference = Regressor(lr=LR, batchnorm=True)
    optimization = reference.configure_optimizers()  # AdamW and the worker's step-interval StepLR
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    data = dataset(SAMPLES)
    norm = reference.net[1]
    for step in range(max_steps):
        contributions = sorted(by_step[step], key=lambda r: (r["group"], r["rank"]))
        assert len({record["quorum_id"] for record in contributions}) == 1, contributions
        committed = {name: buffer.clone() for name, buffer in norm.named_buffers()}
        losses, changes = [], []
        for record in contributions:
            for name, buffer in norm.named_buffers():  # .data: the previous forward's graph saved these tensors
                buffer.data.copy_(committed[name])
            x, y = data[record["ids"]]
            losses.append(torch.nn.functional.mse_loss(reference.net(x), y))
            changes.append({n: b.double() - committed[n].double() for n, b in norm.named_buffers()})
        optimizer.zero_grad()
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        scheduler.step()
        for name, buffer in norm.named_buffers():
            mean = sum(change[name] for change in changes) / len(changes)
            buffer.copy_(committed[name].double() + (mean if buffer.is_floating_point() else mean.floor()))
    return reference.state_dict(), optimizer.state_dict()


def test_a_batchnorm_model_with_adamw_and_a_rejected_vote_steps_as_one_process_replaying_the_committed_steps(launch):
    """2 groups × 1 process, synchronous quorum, AdamW with a step-interval schedule, a BatchNorm model, and one step
    rejected by every group (group 0's gradient is NaN at step 6). One process replaying every committed step on the
    contributing groups' samples ends with the groups' parameters, running statistics and AdamW state, to float
    summation order (the groups sum their gradients in another order); the replicas are bit-identical to each other."""
    max_steps = 16
    nan = inject({"kind": "nan", "group": 0, "step": 6})
    args = [f"--max-steps={max_steps}", "--async-quorum=0", "--batchnorm", f"--lr={LR}", f"--seed={SEED}",
            f"--index-data={SAMPLES}", nan, *GATES]  # fmt: skip
    job = launch(groups=2, worker_args=args)
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit() == 0, job.tail()
    rejected = [e for e in job.events("step", committed=False) if e["step"] == 6]
    assert {e["group"] for e in rejected} == {0, 1}, f"every group rejects step 6: {job.events('step_rejected')}"
    states = job.final_states()
    assert_bit_identical(states, replicas=2)
    model, optimizer = replay_with_buffers(job, max_steps)
    for key, state in states.items():
        assert state["global_step"] == max_steps, key
        for name, tensor in model.items():
            if tensor.is_floating_point():
                torch.testing.assert_close(state["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
            else:
                assert torch.equal(state["model"][name], tensor), (key, name)
        for index, expected in optimizer["state"].items():
            for field, value in expected.items():
                torch.testing.assert_close(
                    state["optimizers"][0]["state"][index][field].float(), value.float(), rtol=1e-4, atol=1e-7,
                    msg=f"{key} optimizer state {index}.{field}",
                )  # fmt: skip


def test_accumulation_over_four_micro_batches_with_a_participant_change_mid_window_steps_as_one_process(launch):
    """2 groups × 1 process, synchronous quorum, SGD, accumulation over 4 micro-batches. Group 1 is SIGKILLed at the
    start of micro-batch 1 of a window (its first micro-batch's gradient is accumulated, none has left the process);
    group 0's step fails at the cross-group allreduce and is not committed, group 0 commits alone meanwhile, and the
    restarted group 1 heals and joins. One process replaying every committed step on the union of the contributing
    groups' four micro-batches ends with the groups' parameters (to float summation order): nothing of the
    half-accumulated window reaches any committed step, and each committed step averages exactly its participants'
    whole windows."""
    from test_your_code import kill_at_gate

    max_steps = 36  # the survivor is held 20 steps after the victim's third, until the restart asks for a quorum
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--accumulate=4", "--async-quorum=0", *SGD, *GATES])
    start_together(job, groups=2, nproc=1)
    kill_at_gate(job, victim=1, survivor=0, gate="micro_batch", value="1", phase="micro_batch")
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)
    assert {e["participants"] for e in job.events("step", group=0, committed=True)} == {1, 2}
    contributions = committed_contributions(job)
    assert all(len(record["ids"]) == 4 * 16 for record in contributions), "a contribution is four whole micro-batches"
    assert_equal_to_replay(job, max_steps)

"""What users bring, under real processes: a model with buffers (BatchNorm), and data code written for plain DDP.

* A BatchNorm model ends as one model through a kill and a heal: parameters *and* running statistics bit-identical
  in every group at the exact committed step count. Without the buffer average (``buffer_sync="off"``) the same job
  ends as two models: the control that shows the first test can fail.
* A user's own ``DistributedSampler(dataset)`` (built from the group's world) is re-sharded to the job's: the two
  groups read disjoint samples at every step.
* An ``IterableDataset`` that shards by ``lightning_ft.job_shard()`` reads disjoint samples; one that shards by
  ``torch.distributed.get_rank()`` (the group's rank) reads the same samples in both groups, and the job says so
  (a ``duplicate_data`` event and a warning with the fix).
* Every optimization mode, each with a group SIGKILLed and healed, ending as one model at the exact committed step
  count: manual optimization with two optimizers and two forward passes per batch, gradient accumulation killed
  mid-window, ``16-mixed`` with a GradScaler (whose state must travel: it is compared), a ``torch.compile``d network
  and ``training_step(dataloader_iter)``.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest
import torch
from harness import LaunchedJob, assert_tree_equal
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

BUFFERS = ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked")


def test_a_batchnorm_model_ends_as_one_model_through_a_kill_and_a_heal(launch):
    """2 groups × 1 process, a BatchNorm model, asynchronous quorum: group 1 is SIGKILLed, restarts and heals. Every
    replica ends at ``max_steps`` with bit-identical parameters, optimizer state *and* buffers (``assert_outcome``
    compares the whole model state), and the running statistics moved: they are not the initial ones."""
    max_steps = 40
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--batchnorm", *GATES])
    start_together(job, groups=2, nproc=1)
    kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)
    state = next(iter(job.final_states().values()))["model"]
    assert int(state["net.1.num_batches_tracked"]) >= max_steps
    assert not torch.equal(state["net.1.running_mean"], torch.zeros_like(state["net.1.running_mean"]))


def test_without_the_buffer_average_the_groups_end_as_two_models(launch):
    """The control: ``buffer_sync="off"``, no fault at all. The parameters agree (gradients are averaged), the
    running statistics do not (each group's come from its own batches): what the test above would see without the
    buffer average."""
    max_steps = 10
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--batchnorm", "--buffer-sync=off", *GATES])
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit() == 0, job.tail()
    states = job.final_states()
    assert len(states) == 2, sorted(states)
    first, second = (state["model"] for state in states.values())
    for name, tensor in first.items():
        if name not in BUFFERS:
            assert torch.equal(tensor, second[name]), name
    assert not torch.equal(first["net.1.running_mean"], second["net.1.running_mean"])


def test_a_batchnorm_model_under_diloco_ends_as_one_model(launch):
    """2 groups × 1 process, DiLoCo with 2 fragments, a sync every 4 inner steps: buffers belong to no fragment, and
    each sync averages their change, so the groups end (at a sync) with one model, running statistics included."""
    max_steps = 16
    args = ["--async-quorum=0", "--algorithm=diloco", "--sync-every=4", "--fragments=2", "--fragment-sync-delay=0"]
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--batchnorm", *args, *GATES])
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit() == 0, job.tail()
    states = job.final_states()
    assert len(states) == 2, sorted(states)
    first, second = (state["model"] for state in states.values())
    assert_tree_equal(first, second, "model")
    assert not torch.equal(first["net.1.running_mean"], torch.zeros_like(first["net.1.running_mean"]))


def samples_by_step(job: LaunchedJob) -> dict[int, dict[int, set[int]]]:
    """For every committed step: the sample ids each group trained on in it."""
    by_step: dict[int, dict[int, set[int]]] = defaultdict(dict)
    for record in job.events("batch", committed=True):
        by_step[record["step"]][record["group"]] = set(record["ids"])
    return by_step


@pytest.mark.parametrize(
    ("user_data", "disjoint"),
    [("sampler", True), pytest.param("job-iterable", True, marks=pytest.mark.paths), ("rank-iterable", False)],
    ids=["distributed-sampler", "iterable-by-job-shard", "iterable-by-group-rank"],
)
def test_data_code_written_for_plain_ddp(launch, user_data: str, disjoint: bool):
    """2 groups × 1 process, 12 committed steps, samples that carry their index. Where the job can shard (a
    ``DistributedSampler`` it re-shards, a dataset that asks ``job_shard()``) the groups read disjoint samples at
    every step and nothing is reported; where only the data code knows (a dataset sharding by the group's rank) the
    groups read the same samples, and the job names both groups in a ``duplicate_data`` event."""
    max_steps = 12
    job = launch(
        groups=2,
        worker_args=[f"--max-steps={max_steps}", f"--user-data={user_data}", "--index-data=512", *GATES],
    )
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit() == 0, job.tail()
    by_step = samples_by_step(job)
    assert sorted(by_step) == list(range(1, max_steps + 1)), sorted(by_step)
    # Every step the two groups took together (the first one always: the job's first step waits for every group; a
    # starved heartbeat may cost a group a later quorum, never the verdict).
    together = {step: groups for step, groups in by_step.items() if len(groups) == 2}
    assert 1 in together, by_step[1]
    for step, groups in together.items():
        if disjoint:
            assert not groups[0] & groups[1], f"step {step}: both groups read samples {sorted(groups[0] & groups[1])}"
        else:
            assert groups[0] == groups[1], f"step {step}: {groups}"
    reports = job.events("duplicate_data")
    if disjoint:
        assert not reports, reports
    else:
        assert {tuple(report["groups"]) for report in reports} == {(0, 1)}, reports
        assert {report["group"] for report in reports} == {0, 1}, "each group says so"


def kill_at_gate(job: LaunchedJob, *, victim: int, survivor: int, gate: str, value: str, phase: str) -> None:
    """As ``kill_and_restart``, but the victim is SIGKILLed where a gate stopped it (``pause.group<V>.<gate>``
    holding ``value``) after it committed steps with its peer; the gate is removed before the restart reads it."""
    attempt = job.attempt(victim, 0)
    pid = job.worker_pid(victim, 0, attempt)
    job.wait_for(
        f"group {victim} to commit 3 steps with its peer",
        lambda: sum(e["participants"] == 2 for e in job.events("step", group=victim, pid=pid, committed=True)) >= 3,
    )
    hold = job.hold_from_step(survivor, max(job.committed_steps(victim, 0, pid)) + 20)
    stop = job.root / f"pause.group{victim}.{gate}"
    stop.write_text(value)
    job.wait_for(f"group {victim} to stop at its gate", lambda: job.events("paused", pid=pid, phase=phase))
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    stop.unlink()
    job.wait_held_alone(survivor, since=killed_at)
    restarted = job.wait_for(f"torchrun to restart group {victim}", lambda: job.worker_pid(victim, 0, attempt + 1))
    job.wait_for(f"group {victim} to ask for its first quorum", lambda: job.events("joining", pid=restarted))
    job.release_until_healed({survivor: hold}, victim, since=killed_at)


@pytest.mark.parametrize("micro_batch", [pytest.param(1, marks=pytest.mark.paths), 3])
def test_accumulation_killed_mid_window_ends_as_one_model(launch, micro_batch: int):
    """Accumulation over 4 micro-batches, BatchNorm and clipping: the victim is SIGKILLed at the start of micro-batch
    1 (mid-window) or 3 (the one that votes) of a window. Nothing of the half-accumulated step survives anywhere;
    the replicas end identical at the exact step count."""
    max_steps = 30
    args = [f"--max-steps={max_steps}", "--accumulate=4", "--clip=0.5", "--batchnorm", *GATES]
    job = launch(groups=2, worker_args=args)
    start_together(job, groups=2, nproc=1)
    kill_at_gate(job, victim=1, survivor=0, gate="micro_batch", value=str(micro_batch), phase="micro_batch")
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)


def test_manual_optimization_with_two_optimizers_ends_as_one_model(launch):
    """Manual optimization, two optimizers, a forward pass for each (the second after the first optimizer stepped,
    as a GAN's second player makes), BatchNorm: the batch's one vote decides both steps, and the second forward's
    change of the running statistics is carried into the next vote. The victim is killed between batches: a kill
    between the vote and the second optimizer's allreduce restarts the survivor too (its collective failed after a
    positive decision: the crash path of ``StepProtocol.commit``, unit-tested in ``test_buffers.py``)."""
    max_steps = 30
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--manual", "--optimizers=2", "--batchnorm",
                                        *GATES])  # fmt: skip
    start_together(job, groups=2, nproc=1)
    kill_at_gate(job, victim=1, survivor=0, gate="batch_start", value="", phase="batch_start")
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)


def test_mixed_precision_a_compiled_network_and_an_iterator_step_survive_a_kill_and_a_heal(launch):
    """One job with all three: ``16-mixed`` on the CPU with a GradScaler (its scale and growth tracker are part of
    the compared final state: a heal that did not load them leaves the restarted group's tracker behind its peer's,
    and a group that heals inside the vote must unscale by the scale it received), a ``torch.compile``d network
    (dynamo's ``OptimizedModule``, ``_orig_mod.`` in the state's names; the eager backend keeps the test short), and
    ``training_step(dataloader_iter)``: a kill between steps, a heal, one model at the exact committed step count."""
    max_steps = 40
    modes = ["--precision=16-mixed", "--compile", "--iterator-step"]
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", *modes, *GATES])
    start_together(job, groups=2, nproc=1)
    kill_and_restart(job, victim=1, rank=0, survivor=0)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)
    state = next(iter(job.final_states().values()))
    assert state["precision"] and "scale" in state["precision"], state["precision"]
    assert any("_orig_mod." in name for name in state["model"]), sorted(state["model"])

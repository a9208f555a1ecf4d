"""What users bring, under real processes: a model with buffers (BatchNorm), and data code written for plain DDP.

* A BatchNorm model ends as one model through a kill and a heal: parameters *and* running statistics bit-identical
  in every group at the exact committed step count. Without the buffer average (``buffer_sync="off"``) the same job
  ends as two models: the control that shows the first test can fail.
* A user's own ``DistributedSampler(dataset)`` (built from the group's world) is re-sharded to the job's: the two
  groups read disjoint samples at every step.
* An ``IterableDataset`` that shards by ``lightning_ft.job_shard()`` reads disjoint samples; one that shards by
  ``torch.distributed.get_rank()`` (the group's rank) reads the same samples in both groups, and the job says so
  (a ``duplicate_data`` event and a warning with the fix).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from harness import LaunchedJob
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart, start_together

pytestmark = [pytest.mark.timeout(420)]

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


def samples_by_step(job: LaunchedJob) -> dict[int, dict[int, set[int]]]:
    """For every committed step: the sample ids each group trained on in it."""
    by_step: dict[int, dict[int, set[int]]] = defaultdict(dict)
    for record in job.events("batch", committed=True):
        by_step[record["step"]][record["group"]] = set(record["ids"])
    return by_step


@pytest.mark.parametrize(
    ("user_data", "disjoint"),
    [("sampler", True), ("job-iterable", True), ("rank-iterable", False)],
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
    for step, groups in by_step.items():
        assert sorted(groups) == [0, 1], (step, groups)
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

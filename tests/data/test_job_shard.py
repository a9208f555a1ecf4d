"""The job's shard for data code (lightning_ft.data.job_shard) and the first-batch comparison
(lightning_ft.callbacks.disjoint_data)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from lightning_ft import FTConfigError, JobShard, job_shard
from lightning_ft.data.job_shard import fit_sampler_to_job, forget_job_shard, publish_job_shard
from lightning_ft_job.environment import ENV_JOB_RANK, ENV_JOB_WORLD_SIZE

DATA = TensorDataset(torch.arange(10).float())
JOB, GROUP = JobShard(rank=3, world_size=4), JobShard(rank=1, world_size=2)  # group 1 of 2 groups of 2 processes


def test_a_sampler_built_for_the_group_is_re_sharded_to_the_job_with_distributed_sampler_s_lengths():
    for drop_last in (False, True):
        sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=False, drop_last=drop_last)
        fit_sampler_to_job(DataLoader(DATA, sampler=sampler), JOB, GROUP)
        reference = DistributedSampler(DATA, num_replicas=4, rank=3, shuffle=False, drop_last=drop_last)
        assert (sampler.num_replicas, sampler.rank) == (4, 3)
        assert list(sampler) == list(reference), drop_last
        assert len(sampler) == len(reference)


def test_a_sampler_inside_a_batch_sampler_is_re_sharded_too():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=False)
    fit_sampler_to_job(DataLoader(DATA, batch_sampler=BatchSampler(sampler, 2, drop_last=False)), JOB, GROUP)
    assert (sampler.num_replicas, sampler.rank) == (4, 3)


@pytest.mark.parametrize("layout", [(4, 3), (1, 0)], ids=["the-job-s", "a-layout-of-the-user-s"])
def test_a_sampler_with_another_layout_is_left_alone(layout: tuple[int, int]):
    sampler = DistributedSampler(DATA, num_replicas=layout[0], rank=layout[1])
    fit_sampler_to_job(DataLoader(DATA, sampler=sampler), JOB, GROUP)
    assert (sampler.num_replicas, sampler.rank) == layout


def test_a_subclass_built_for_the_group_is_refused_naming_it_and_the_fix():
    class Bucketed(DistributedSampler):
        pass

    sampler = Bucketed(DATA, num_replicas=2, rank=1)
    refused = r"Bucketed shards over this replica group's 2 process\(es\).*num_replicas=4"
    with pytest.raises(FTConfigError, match=refused):
        fit_sampler_to_job(DataLoader(DATA, sampler=sampler), JOB, GROUP)
    assert (sampler.num_replicas, sampler.rank) == (2, 1), "refused, not changed"


def test_one_group_changes_nothing():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1)
    fit_sampler_to_job(DataLoader(DATA, sampler=sampler), GROUP, GROUP)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)


def test_job_shard_answers_what_the_strategy_published_and_falls_back_outside_it(monkeypatch):
    monkeypatch.delenv(ENV_JOB_RANK, raising=False)
    monkeypatch.setenv(ENV_JOB_WORLD_SIZE, "7")  # a value from before the fit comes back after it
    assert job_shard() == JobShard(0, 1)  # no process group, no strategy
    before = publish_job_shard(JOB)
    try:
        assert job_shard() == JOB
    finally:
        forget_job_shard(before)
    assert ENV_JOB_RANK not in os.environ and os.environ[ENV_JOB_WORLD_SIZE] == "7"
    assert job_shard() == JobShard(0, 1)

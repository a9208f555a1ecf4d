"""Which shard of the whole job this process reads: the job-wide ``get_rank()`` and ``get_world_size()``.

Under FTStrategy the torch default process group spans one replica group, so ``torch.distributed.get_rank()`` and
``get_world_size()`` describe the group, not the job. Data code that shards by them reads the same samples in every
group: the job does the work of one group at the price of all of them. This module gives data code the job's view:
``num_replica_groups × group size`` ranks, ordered by group, then by rank in the group, the order of
``FTStrategy.distributed_sampler_kwargs``.

* :func:`job_shard` for an ``IterableDataset`` (or any code that shards by hand). It reads environment variables that
  FTStrategy sets in every process before any dataloader is built, so DataLoader worker processes (forked or spawned)
  see them too.
* :func:`fit_sampler_to_job`: a ``DistributedSampler`` that the user built from the group's world (the usual
  ``DistributedSampler(dataset)`` of DDP code) is re-sharded to the job's world, or refused when it cannot be.

A group's shard is fixed by its id, whatever the other groups do: while a group is down its shard is not read
(``data_mode="exactly_once"`` reads every sample of an epoch exactly once instead, ``docs/elasticity.md``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_ft.settings import FTConfigError
from lightning_ft_job.environment import ENV_JOB_RANK, ENV_JOB_WORLD_SIZE

log = logging.getLogger("lightning.pytorch.lightning_ft")


@dataclass(frozen=True)
class JobShard:
    """This process's rank among every process of the job, and their number.

    Attributes:
        rank: This process's job-wide rank, in ``[0, world_size)``.
        world_size: How many processes the job has: ``num_replica_groups × group size`` under FTStrategy.
    """

    rank: int
    world_size: int


def job_shard() -> JobShard:
    """The job-wide rank and world size of this process (also inside a DataLoader worker).

    Under FTStrategy: ``replica_group_id × group size + group rank`` of ``num_replica_groups × group size``. Outside
    it, torch.distributed's rank and world size when a process group exists, else rank 0 of 1, so that a dataset
    written with it runs unchanged in plain DDP or in one process. Combine it with
    ``torch.utils.data.get_worker_info()`` to split a shard further among DataLoader workers.

    Returns:
        This process's job-wide rank and the job's world size (rank 0 of 1 outside any distributed run).
    """
    rank, world_size = os.environ.get(ENV_JOB_RANK), os.environ.get(ENV_JOB_WORLD_SIZE)
    if rank is not None and world_size is not None:
        return JobShard(int(rank), int(world_size))
    if dist.is_available() and dist.is_initialized():
        return JobShard(dist.get_rank(), dist.get_world_size())
    return JobShard(0, 1)


def publish_job_shard(shard: JobShard) -> dict[str, str | None]:
    """Make :func:`job_shard` answer ``shard`` in this process and in every process it starts from now on (the
    DataLoader workers of the fit). Returns what the variables held before, for :func:`forget_job_shard`."""
    previous = {name: os.environ.get(name) for name in (ENV_JOB_RANK, ENV_JOB_WORLD_SIZE)}
    os.environ[ENV_JOB_RANK] = str(shard.rank)
    os.environ[ENV_JOB_WORLD_SIZE] = str(shard.world_size)
    return previous


def forget_job_shard(previous: dict[str, str | None]) -> None:
    """After the strategy's teardown: the variables as they were before :func:`publish_job_shard`, so that a fit
    leaves the process environment as it found it."""
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def fit_sampler_to_job(dataloader: object, job: JobShard, group: JobShard) -> None:
    """Re-shard, in place, a ``DistributedSampler`` that shards over the group's world instead of the job's.

    A sampler built for the job (``num_replicas`` and ``rank`` of ``FTStrategy.distributed_sampler_kwargs``, as
    Lightning's own is) and one with another explicit layout are left as they are. One built for the group's world
    (``DistributedSampler(dataset)``, which reads torch.distributed) is given the job's ``num_replicas`` and
    ``rank``, and its length is recomputed as ``DistributedSampler.__init__`` does. That is exact for torch's
    ``DistributedSampler`` and torchdata's ``StatefulDistributedSampler``, whose iteration reads nothing else; a
    subclass of another kind may derive more from the layout in its ``__init__``, so it is refused with an
    :class:`~lightning_ft.settings.FTConfigError` that names it and the fix.
    """
    if not isinstance(dataloader, DataLoader) or job.world_size == group.world_size:
        return
    sampler = dataloader.sampler
    batch_sampler = dataloader.batch_sampler
    if not isinstance(sampler, DistributedSampler) and batch_sampler is not None:
        sampler = getattr(batch_sampler, "sampler", sampler)  # DataLoader(batch_sampler=BatchSampler(sampler, ...))
    if not isinstance(sampler, DistributedSampler):
        return
    if (sampler.num_replicas, sampler.rank) != (group.world_size, group.rank):
        return  # built for the job, or with a layout of the user's own
    name = f"{type(sampler).__module__}.{type(sampler).__qualname__}"
    if name not in _RESHARDABLE:
        raise FTConfigError(
            f"lightning-ft: the DataLoader's sampler {name} shards over this replica group's "
            f"{group.world_size} process(es) (num_replicas={sampler.num_replicas}, rank={sampler.rank}), so every "
            f"group would read the same samples. Build it with the job's layout, "
            f"{type(sampler).__name__}(dataset, **trainer.strategy.distributed_sampler_kwargs) (num_replicas="
            f"{job.world_size}, rank={job.rank} here), or leave the sampler to Lightning."
        )
    size = len(sampler.dataset)  # type: ignore[arg-type]
    sampler.num_replicas, sampler.rank = job.world_size, job.rank
    if sampler.drop_last and size % job.world_size:
        sampler.num_samples = math.ceil((size - job.world_size) / job.world_size)
    else:
        sampler.num_samples = math.ceil(size / job.world_size)
    sampler.total_size = sampler.num_samples * job.world_size
    log.info(
        "lightning-ft: re-sharded the DataLoader's %s from this group's %d process(es) to the job's %d (rank %d), so "
        "that no two replica groups read the same samples",
        type(sampler).__name__,
        group.world_size,
        job.world_size,
        job.rank,
    )


_RESHARDABLE = frozenset(
    {
        "torch.utils.data.distributed.DistributedSampler",
        "torchdata.stateful_dataloader.sampler.StatefulDistributedSampler",
    }
)

"""The environment variables through which a launcher configures the processes of a replica group.

``lightning-ft launch`` (and the torchx component, SLURM and Kubernetes recipes of ``docs/operations.md``) set them;
:mod:`lightning_ft.settings` reads them when ``FTStrategy`` is built. Their names live here, beside the launcher,
so that both sides use one spelling and the launcher does not import Lightning to learn it.
"""

from __future__ import annotations

import os

ENV_REPLICA_GROUP_ID = "REPLICA_GROUP_ID"
ENV_NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
# The address a group advertises to its peers (set by `lightning-ft launch` for a local job, or by the user), or the
# network interface whose address it advertises.
ENV_HOSTNAME = "LIGHTNING_FT_HOSTNAME"
ENV_INTERFACE = "LIGHTNING_FT_INTERFACE"
# How long a group waits for every group of the job to start before the job starts with those present (seconds).
ENV_START_TIMEOUT = "LIGHTNING_FT_START_TIMEOUT"
# A folder where each group's torchrun agent writes every thread's Python stack when sent SIGUSR1
# (lightning_ft_job.torchrun_agent): what an agent that does not end is doing.
ENV_STACKS_DIR = "LIGHTNING_FT_STACKS_DIR"
# Set by torchrun's agent in every process it starts.
ENV_TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_TORCHRUN_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def torchrun_restart_count() -> int:
    """How many times torchrun has restarted this process's group: 0 in its first life, and outside torchrun."""
    return int(os.environ.get(ENV_TORCHRUN_RESTART_COUNT, "0"))


# Set by FTStrategy in every process of a job (and so inherited by its DataLoader workers): this process's rank among
# every process of every replica group, and their number (lightning_ft.data.job_shard).
ENV_JOB_RANK = "LIGHTNING_FT_JOB_RANK"
ENV_JOB_WORLD_SIZE = "LIGHTNING_FT_JOB_WORLD_SIZE"

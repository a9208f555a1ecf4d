"""How one replica group runs as a torchrun job: the agent's arguments and the variables every group needs.

``lightning-ft launch`` and the torchx component both start each group as a standalone torchrun job whose elastic
agent restarts the group's failed workers (``--max-restarts``). This is the one place that says how, so that the two
cannot drift apart.
"""

from __future__ import annotations

from lightning_ft_job.environment import ENV_LIGHTHOUSE, ENV_NUM_REPLICA_GROUPS, ENV_REPLICA_GROUP_ID


def torchrun_arguments(nproc_per_group: int, max_restarts: int) -> list[str]:
    """``python``'s arguments up to the worker's command: a one-host torchrun job that restarts failed workers.

    ``--standalone`` runs the group's rendezvous on this host, on a free port, so groups on one machine never share
    one: a group spans one host here, and a group that spans several is a torchrun rendezvous of its own
    (``docs/operations.md``). The agent is torchrun's own, ending without the interpreter's teardown
    (:mod:`lightning_ft_job.torchrun_agent`).
    """
    return [
        "-m",
        "lightning_ft_job.torchrun_agent",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc_per_group}",
        f"--max-restarts={max_restarts}",
    ]


def group_variables(group_id: int, num_groups: int, lighthouse: str) -> dict[str, str]:
    """The environment that makes a torchrun job replica group ``group_id`` of ``num_groups``."""
    return {
        ENV_REPLICA_GROUP_ID: str(group_id),
        ENV_NUM_REPLICA_GROUPS: str(num_groups),
        ENV_LIGHTHOUSE: lighthouse,
        # Restarted Gloo workers cannot connect through torchrun's shared rendezvous store (pytorch issue 135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }

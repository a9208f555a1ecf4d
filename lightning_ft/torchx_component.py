"""A torchx component for a lightning-ft job: one lighthouse and N replica groups, each a torchrun job with restarts.

torchx is the engine here: it starts the roles on whichever scheduler it is given (``local_cwd`` on one machine,
``slurm``, ``kubernetes``, ...), and restarting a failed group stays torchrun's job inside that group's role
(``--max-restarts``), exactly as with ``lightning-ft launch``. Nothing in this module manages a cluster: it only
describes the job. Install the extra with ``pip install '.[torchx]'`` in a clone, then from the command line (torchx
reads a component from its file)::

    torchx run -s local_cwd "$(python -c 'import lightning_ft.torchx_component as c; print(c.__file__)')":ft_job \
        --script train.py --replica_groups 2 -- fit --config ft.yaml

or from Python: ``torchx.runner.get_runner().run(ft_job("fit", script="train.py"), scheduler="slurm")``. To call it
``lightning_ft.ft_job`` instead, register ``lightning_ft = "lightning_ft.torchx_component"`` under your own
project's ``torchx.components`` entry points (lightning-ft does not: that entry point hides torchx's builtins).

The roles:

* ``lighthouse``: torchft's own ``torchft_lighthouse`` binary, which starts in a second (no Lightning import), on
  ``lighthouse_port`` of its host.
* ``group0`` .. ``group{N-1}``: ``python -m lightning_ft_job.torchrun_agent --standalone --nproc-per-node K
  --max-restarts R SCRIPT ARGS`` (torchrun's agent: :mod:`lightning_ft_job.torchrun_agent`) with
  ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (restarted Gloo workers cannot reconnect without it, pytorch issue 135712), and ``LIGHTNING_FT_RUN_ID``, the
  torchx app id (one event log directory for the whole run).
  One host per group; a group spanning several hosts is a torchrun rendezvous of its own (``docs/operations.md``).

Where the groups find the lighthouse: ``lighthouse`` (a URL) when the job should join a lighthouse that runs as a
service of its own (the usual choice on a cluster: it then outlives the job's roles), otherwise
``http://{lighthouse_host}:{lighthouse_port}``, where ``lighthouse_host`` is the address at which the scheduler
places the lighthouse role (``localhost`` with ``local_cwd``).
"""

# No `from __future__ import annotations` and no `X | None`: torchx reads the component's signature from its source
# and understands only typing's Optional, Dict and List there.
from typing import Dict, List, Optional

from torchx import specs

from lightning_ft.settings import FTConfigError
from lightning_ft_job.events import ENV_RUN_ID
from lightning_ft_job.torchrun import group_variables, torchrun_arguments

LIGHTHOUSE_ROLE = "lighthouse"


def ft_job(
    *script_args: str,
    script: str,
    replica_groups: int = 2,
    nproc_per_group: int = 1,
    max_restarts: int = 3,
    min_replicas: int = 1,
    lighthouse: Optional[str] = None,
    lighthouse_host: str = "localhost",
    lighthouse_port: int = 29510,
    heartbeat_timeout_ms: int = 5000,
    join_timeout_ms: int = 10000,
    image: str = ".",
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 4096,  # torchx's resource name
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """A lighthouse and ``replica_groups`` replica groups, each a torchrun job that restarts its failed workers.

    Args:
        script_args: arguments of the training script
        script: the training script (its trainer uses ``strategy="ft"`` or ``FTStrategy``)
        replica_groups: number of replica groups (N)
        nproc_per_group: processes per group (K, one host)
        max_restarts: torchrun restarts per group before the group gives up
        min_replicas: fewest groups that may form a quorum (the lighthouse role's setting)
        lighthouse: URL of a lighthouse that runs elsewhere; then no lighthouse role is started
        lighthouse_host: where the groups reach the lighthouse role (``localhost`` with local_cwd)
        lighthouse_port: the lighthouse role's port
        heartbeat_timeout_ms: the lighthouse role declares a group dead after this long without a heartbeat
        join_timeout_ms: how long the lighthouse role waits for heartbeating groups to join a new quorum
        image: the image (a directory with local_cwd, a container image on Kubernetes)
        cpu: CPUs per group
        gpu: GPUs per group
        memMB: memory per group, in MB
        env: extra environment variables of every group
    """
    if replica_groups < 1 or nproc_per_group < 1 or max_restarts < 0:
        raise FTConfigError("ft_job: replica_groups and nproc_per_group must be >= 1, max_restarts >= 0")
    if not 1 <= min_replicas <= replica_groups:
        raise FTConfigError(f"ft_job: min_replicas={min_replicas} must be in [1, replica_groups={replica_groups}]")
    roles: List[specs.Role] = []
    url = lighthouse
    if url is None:
        url = f"http://{lighthouse_host}:{lighthouse_port}"
        roles.append(
            specs.Role(
                name=LIGHTHOUSE_ROLE,
                image=image,
                entrypoint="torchft_lighthouse",
                args=[
                    f"--bind=[::]:{lighthouse_port}",
                    f"--min_replicas={min_replicas}",
                    f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
                    f"--join_timeout_ms={join_timeout_ms}",
                ],
                resource=specs.Resource(cpu=1, gpu=0, memMB=1024),
                port_map={"lighthouse": lighthouse_port},
            )
        )
    for group in range(replica_groups):
        roles.append(
            specs.Role(
                name=f"group{group}",
                image=image,
                entrypoint="python",
                args=[*torchrun_arguments(nproc_per_group, max_restarts), script, *script_args],
                # One run id for every group (torchrun --standalone gives each group its own): one event log
                # directory per run (lightning_ft_job.events); torchx substitutes the app's id at run time.
                env={ENV_RUN_ID: specs.macros.app_id, **(env or {}), **group_variables(group, replica_groups, url)},
                resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB),
            )
        )
    return specs.AppDef(name="lightning-ft", roles=roles)

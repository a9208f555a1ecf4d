"""What each replica group's processes find in their environment when ``lightning-ft launch`` starts them: the job's
variables (:mod:`lightning_ft_job.torchrun`), the run's id and folders, and the settings that keep a one-machine job
quiet, off the network and off each other's cores."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from lightning_ft_job.addresses import LOOPBACK, is_loopback, loopback_interface
from lightning_ft_job.environment import ENV_HOSTNAME, ENV_INTERFACE, ENV_START_TIMEOUT
from lightning_ft_job.events import ENV_EVENTS_DIR, ENV_RUN_ID
from lightning_ft_job.run_end import ENV_RUN_END_DIR
from lightning_ft_job.torchrun import group_variables

# The threads each group's processes start, unless the user set them:
# - OMP_NUM_THREADS: torchrun sets it only for more than one process per node; groups sharing cores need it either way.
# - TOKIO_WORKER_THREADS: torchft's ManagerServer and ManagerClient each start a tokio runtime of min(4, cores) worker
#   threads, and every quorum wakes several of them. A group serves a few RPCs per step, which one worker thread
#   handles; on one machine running every group, the spare threads' wake-ups compete with training
#   (docs/benchmarks.md). torchft reads this variable when it builds those runtimes.
GROUP_THREADS = {"OMP_NUM_THREADS": "1", "TOKIO_WORKER_THREADS": "1"}


def group_environment(
    group_id: int,
    num_groups: int,
    lighthouse: str,
    events_dir: str | None,
    start_timeout: float | None = None,
    run_id: str | None = None,
    run_end_dir: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ)
    if run_end_dir is not None:  # where a group reports the run's end, and a restarted one learns of it
        env[ENV_RUN_END_DIR] = os.path.abspath(run_end_dir)
    env.update(group_variables(group_id, num_groups, lighthouse))
    if run_id is not None:  # one run id for every group and restart: one event directory per run
        env[ENV_RUN_ID] = run_id
    if start_timeout is not None:
        env[ENV_START_TIMEOUT] = f"{start_timeout:g}"
    for name, value in GROUP_THREADS.items():
        env.setdefault(name, value)
    # torchft's Rust side logs several INFO lines per step; keep group output readable unless asked for (--verbose).
    env.setdefault("RUST_LOG", "warn")
    env["PYTHONUNBUFFERED"] = "1"
    if events_dir:
        env[ENV_EVENTS_DIR] = os.path.abspath(events_dir)
    env.update(local_listener_environment(lighthouse, env))
    return env


def local_listener_environment(lighthouse: str, env: dict[str, str]) -> dict[str, str]:
    """Keep a one-machine job off the network: what to add to the groups' environment.

    A lighthouse on a loopback address is reachable from this machine only, so every group is on this machine too:
    the groups advertise (and so bind, see :mod:`lightning_ft.manager.listeners`) loopback, and Gloo's pairs bind to the
    loopback interface. Values the user already set are kept.
    """
    host = urlsplit(lighthouse).hostname or ""
    if not is_loopback(host):
        return {}
    extra = {}
    if ENV_HOSTNAME not in env and ENV_INTERFACE not in env:  # a chosen interface is the user's choice of address
        extra[ENV_HOSTNAME] = LOOPBACK
    interface = loopback_interface()
    if "GLOO_SOCKET_IFNAME" not in env and interface is not None:
        extra["GLOO_SOCKET_IFNAME"] = interface
    return extra

"""Beyond one machine, on three test hosts built from network namespaces (``netns.py``): the lighthouse on host A,
replica group 0 on host B, group 1 on host C, each group started on its own host by ``lightning-ft launch
--lighthouse URL --group-ids G``, and each bound to its own address, chosen by name (``LIGHTNING_FT_HOSTNAME``) for
group 0 and by network interface (``LIGHTNING_FT_INTERFACE``) for group 1, as in the multi-host recipe of
``docs/operations.md``.

A namespace holds only its own address, so every byte between the groups (the heal included) crosses the virtual
network between the hosts.
"""

from __future__ import annotations

import pytest
from harness import LaunchedJob, launch_job
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart
from test_network_partition import LIGHTHOUSE_PORT, network, start_lighthouse, stop_process  # noqa: F401 - fixture

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(420)
def test_a_group_killed_on_its_host_restarts_there_and_heals_from_the_other_host(network, tmp_path):  # noqa: F811
    """SIGKILL group 1's worker on host C: the torchrun job of that host restarts it there, it heals from group 0 on
    host B across the virtual network, and both replicas end bit-identical at max_steps."""
    max_steps = 60
    lighthouse = start_lighthouse(network, tmp_path / "lighthouse.log")
    url = f"http://lighthouse:{LIGHTHOUSE_PORT}"
    root = tmp_path / "job"
    jobs: list[LaunchedJob] = []
    try:
        for group in (0, 1):
            host = f"group{group}"
            jobs.append(
                launch_job(
                    root,  # one event log for the job: each host's launcher writes its own group's files into it
                    groups=2,
                    worker_args=[f"--max-steps={max_steps}", *GATES],
                    launcher_args=[f"--lighthouse={url}", f"--group-ids={group}"],
                    wrap=lambda argv, host=host: network.command(host, argv),
                    # Group 0 advertises its host's name, group 1 its host's interface (the IPv4 address of eth0).
                    env={"LIGHTNING_FT_HOSTNAME": host} if group == 0 else {"LIGHTNING_FT_INTERFACE": "eth0"},
                    log_name=f"{host}.log",
                )
            )
        job0, job1 = jobs
        job0.wait_for("both groups to start", lambda: all(job0.worker_pid(g, 0) for g in (0, 1)), timeout=240)
        (root / "go").touch()
        first_pid = job1.worker_pid(1, 0)
        kill_and_restart(job1, victim=1, rank=0, survivor=0)
        assert job0.wait_exit(timeout=240) == 0, job0.tail()
        assert_outcome(job1, restarted=1, max_steps=max_steps, replicas=2)
    finally:
        for job in jobs:
            job.stop()
        stop_process(lighthouse)

    restarted = job1.events("started", group=1)
    # Restarted at least once (a restart whose first quorum failed on a starved heartbeat is restarted again).
    assert [e["pid"] for e in restarted][:1] == [first_pid] and len(restarted) >= 2, restarted
    # The restart ran on host C: both workers are children of the one torchrun agent started there.
    assert len({e["ppid"] for e in restarted}) == 1, restarted
    assert len(job0.events("started", group=0)) == 1, "group 0 must not have been restarted"

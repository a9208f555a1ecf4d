"""The torchx component (``lightning_ft.torchx_component.ft_job``) runs a real job with torchx's ``local_cwd``
scheduler: a lighthouse role and two replica-group roles, each a torchrun job, which train to the end identically."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
from harness import REPO, WORKER, assert_bit_identical, process_gone
from torchx.runner import get_runner
from torchx.specs import AppState

from lightning_ft.torchx_component import ft_job
from lightning_ft_job.events import read_events

pytestmark = [pytest.mark.multiprocess]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finished_on_their_own(out: Path, events: Path) -> bool:
    """Both groups wrote their final state and their workers have exited (before the test cancels anything)."""
    if len(list(out.glob("final.group*.pt"))) < 2:
        return False
    pids = {e["pid"] for e in read_events(events) if e["event"] == "started"}
    return all(process_gone(pid) for pid in pids)


def test_the_component_describes_a_lighthouse_and_one_torchrun_role_per_group():
    app = ft_job("fit", script="train.py", replica_groups=3, nproc_per_group=2, max_restarts=5, lighthouse_port=1234)
    assert [role.name for role in app.roles] == ["lighthouse", "group0", "group1", "group2"]
    group = app.roles[3]
    assert group.args[-2:] == ["train.py", "fit"]
    assert "--nproc-per-node=2" in group.args and "--max-restarts=5" in group.args
    assert group.env["REPLICA_GROUP_ID"] == "2" and group.env["NUM_REPLICA_GROUPS"] == "3"
    assert group.env["TORCHFT_LIGHTHOUSE"] == "http://localhost:1234"
    assert group.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert group.env["LIGHTNING_FT_RUN_ID"] == "${app_id}", "every group of the app in one run's event directory"
    external = ft_job(script="train.py", lighthouse="http://lh.internal:29510")
    assert [role.name for role in external.roles] == ["group0", "group1"]
    assert external.roles[0].env["TORCHFT_LIGHTHOUSE"] == "http://lh.internal:29510"
    with pytest.raises(ValueError, match="min_replicas=3"):
        ft_job(script="train.py", replica_groups=2, min_replicas=3)


@pytest.mark.timeout(300)
def test_the_component_runs_a_job_with_the_local_cwd_scheduler(tmp_path, monkeypatch):
    # As in an activated virtual environment: the roles' `python` and `torchft_lighthouse` are this interpreter's.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    max_steps = 30
    out, events = tmp_path / "out", tmp_path / "events"
    app = ft_job(
        f"--max-steps={max_steps}",
        f"--out-dir={out}",
        script=str(WORKER),
        replica_groups=2,
        max_restarts=0,
        min_replicas=2,
        lighthouse_host="127.0.0.1",
        lighthouse_port=free_port(),
        heartbeat_timeout_ms=1000,
        image=str(REPO),
        env={"LIGHTNING_FT_EVENTS_DIR": str(events), "OMP_NUM_THREADS": "1", "LIGHTNING_FT_HOSTNAME": "127.0.0.1"},
    )
    runner = get_runner()
    handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": str(tmp_path / "torchx")})
    try:
        deadline = time.monotonic() + 240
        while not finished_on_their_own(out, events):
            status = runner.status(handle)
            assert status is not None and status.state not in (AppState.FAILED, AppState.CANCELLED), status
            assert time.monotonic() < deadline, f"the job did not finish within 240 s: {runner.status(handle)}"
            time.sleep(0.5)
    finally:
        runner.cancel(handle)  # the lighthouse role runs until cancelled; torchx stops the processes it started
        runner.close()

    import torch

    states = {}
    for path in sorted(out.glob("final.group*.rank*.pt")):
        group, rank = path.name.removeprefix("final.group").removesuffix(".pt").split(".rank")
        states[(int(group), int(rank))] = torch.load(path, weights_only=True)
    assert sorted(states) == [(0, 0), (1, 0)]
    for key, state in states.items():
        assert state["global_step"] == max_steps and state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=2)
    commits = [e for e in read_events(events) if e["event"] == "step" and e.get("committed")]
    assert {e["participants"] for e in commits} == {2}, "every step must have committed with both groups"

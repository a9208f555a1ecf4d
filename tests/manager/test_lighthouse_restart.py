"""Lighthouse loss: SIGKILL the lighthouse under two training groups, start a new one at the same address.

The groups must stall with a clear message, resume committing once the new lighthouse is up, and finish as if
nothing happened: no restart, no committed step lost, no uncommitted step applied, replicas bit-identical. The unit
tests below drive :class:`~lightning_ft.manager.lighthouse_outage.OutageTolerantClient` with a fake client, probe
and clock.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, LaunchedJob, assert_bit_identical, assert_tree_equal
from helpers import FakeClock
from matrix import write
from test_fault_tolerance import GATES, start_together

from lightning_ft import FTConfigError, FTStrategy, LighthouseUnavailableError
from lightning_ft.manager.lighthouse_outage import (
    PROBE_INTERVAL_S,
    REJOIN_GRACE_S,
    OutageTolerantClient,
    PendingRequest,
    lighthouse_reachable,
)
from lightning_ft_cli import report
from lightning_ft_cli.timeline import load_timeline

LIGHTHOUSE_URL = "http://127.0.0.1:29510"
JOIN_TIMEOUT_S = 10.0  # the standalone lighthouse's join timeout below
# Where both LocalSGD groups (a sync every 4 batches) wait for the lighthouse's kill: after the third sync, before the
# fourth.
HELD_AT_STEP, SYNC_CYCLE = 14, (4, 2)


# ---------------------------------------------------------------------------------------------------- unit tests


class ScriptedClient:
    """A ManagerClient whose quorum requests give the scripted outcomes in turn (an exception is raised)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.requests: list[dict[str, Any]] = []

    def _quorum(self, **request: Any) -> Any:
        self.requests.append(request)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        self.requests.append({"should_commit": (args, kwargs)})
        return False  # a vote against: the wrapper must hand back the wrapped client's answer, not its own


def guarded(client: ScriptedClient, reachable: Callable[[str], bool], clock: FakeClock, limit: float | None = 60.0):
    return OutageTolerantClient(
        client, LIGHTHOUSE_URL, limit, reachable=reachable, clock=clock, sleep=clock.sleep, probe_interval=0.01
    )


def request(step: int = 7) -> dict[str, Any]:
    return {"group_rank": 0, "step": step, "checkpoint_metadata": "", "shrink_only": False, "timeout": 10}


def test_quorums_pass_through_untouched_while_the_lighthouse_is_up():
    client = ScriptedClient("quorum")
    probes: list[str] = []
    outage = guarded(client, lambda url: probes.append(url) or True, FakeClock())
    assert outage._quorum(**request()) == "quorum"
    assert client.requests == [request()]
    assert outage.should_commit(0, 7, True) is False  # everything else is the wrapped client's, answer included
    assert client.requests[-1] == {"should_commit": ((0, 7, True), {})} and probes == []


def test_a_quorum_failure_with_the_lighthouse_up_is_torchfts_error_unchanged():
    failure = TimeoutError("status: Cancelled, message: Timeout expired")
    outage = guarded(ScriptedClient(failure), lambda url: True, FakeClock())
    with pytest.raises(TimeoutError) as raised:
        outage._quorum(**request())
    assert raised.value is failure


def test_an_outage_stalls_warns_once_and_asks_again_for_the_same_step(caplog):
    """The first request fails while the lighthouse is down; after it is back (and stayed up for the rejoin grace)
    the same step is asked for again, once, and its quorum returned. One warning for the outage, one on resuming."""
    clock = FakeClock()
    client = ScriptedClient(TimeoutError("Timeout expired"), TimeoutError("held back by a fresh lighthouse"), "quorum")
    down_until = 30.0

    outage = guarded(client, lambda url: clock.now >= down_until, clock)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.lightning_ft"):
        assert outage._quorum(**request(step=7)) == "quorum"
    assert client.requests == [request(step=7)] * 3
    assert clock.now >= down_until + outage._rejoin_grace, "asked again before the rejoin grace"
    stalled, resumed = [record for record in caplog.records if "lighthouse" in record.getMessage()]
    assert (stalled.levelno, resumed.levelno) == (logging.WARNING, logging.INFO)
    stalled, resumed = stalled.getMessage(), resumed.getMessage()
    assert LIGHTHOUSE_URL in stalled and "stalled at committed step 7" in stalled
    assert "restart the lighthouse at the same address" in stalled
    assert "is back; training resumes at committed step 7" in resumed


def test_an_outage_longer_than_the_limit_fails_naming_the_setting():
    clock = FakeClock()
    client = ScriptedClient(TimeoutError("Timeout expired"))
    outage = guarded(client, lambda url: False, clock, limit=120.0)
    with pytest.raises(LighthouseUnavailableError, match="lighthouse_outage_timeout=120s") as raised:
        outage._quorum(**request())
    assert LIGHTHOUSE_URL in str(raised.value)
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert len(client.requests) == 1, "no request is made while the lighthouse is known to be down"
    assert 120.0 < clock.now < 121.0


def rescue_setup(clock: FakeClock, reachable: list[bool]) -> tuple[OutageTolerantClient, list[ScriptedClient], Any]:
    """A wrapper whose fresh clients are recorded, and a pending request (as :meth:`_attempt` leaves it)."""
    fresh: list[ScriptedClient] = []

    def new_client() -> ScriptedClient:
        fresh.append(ScriptedClient("the rescue's own quorum"))
        return fresh[-1]

    outage = OutageTolerantClient(
        ScriptedClient(), LIGHTHOUSE_URL, 600.0, reachable=lambda url: reachable[0], clock=clock, sleep=clock.sleep,
        new_client=new_client,
    )  # fmt: skip
    outage._pending = pending = PendingRequest(clock(), request(step=7))
    return outage, fresh, pending


def wait_rescued(fresh: list[ScriptedClient], count: int) -> None:
    deadline = time.monotonic() + 10
    while sum(len(client.requests) for client in fresh) < count:
        assert time.monotonic() < deadline, "the rescue request was not made"
        time.sleep(0.01)


def test_a_request_pending_while_the_lighthouse_was_down_is_rescued_once_after_the_rejoin_grace():
    """The request in flight when the lighthouse died is never answered by torchft's ManagerServer. Once a probe
    failed during it and the lighthouse has been back for the rejoin grace, the same request goes out once from a
    fresh connection (whose quorum answers the hanging one too); not before the grace, and not twice."""
    clock, reachable = FakeClock(), [False]
    outage, fresh, pending = rescue_setup(clock, reachable)
    outage._check(pending)
    assert pending.doomed and not fresh
    reachable[0] = True
    outage._check(pending)
    clock.sleep(outage._rejoin_grace - 0.5)
    outage._check(pending)
    assert not fresh, "rescued before the lighthouse had been back for the rejoin grace"
    clock.sleep(0.5)
    outage._check(pending)
    wait_rescued(fresh, 1)
    assert fresh[0].requests == [request(step=7)] and outage.rescues == 1
    outage._check(pending)
    assert outage.rescues == 1, "a second rescue for the same return of the lighthouse"
    reachable[0] = False  # down again: the rescue's quorum failed too; the next return gets another rescue
    outage._check(pending)
    reachable[0] = True
    outage._check(pending)
    clock.sleep(outage._rejoin_grace)
    outage._check(pending)
    wait_rescued(fresh, 2)
    assert outage.rescues == 2


def test_a_request_never_pending_during_an_outage_is_not_rescued():
    """A slow quorum with the lighthouse up (a group waiting for its peers) is left alone: a second request from the
    same rank would stay in the ManagerServer and pair with the next step's."""
    clock = FakeClock()
    outage, fresh, pending = rescue_setup(clock, [True])
    for _ in range(3):
        outage._check(pending)
        clock.sleep(outage._rejoin_grace)
    assert not pending.doomed and not fresh and outage.rescues == 0


def test_lighthouse_outage_timeout_is_validated():
    assert FTStrategy().settings.lighthouse_outage_timeout.total_seconds() == 600
    assert FTStrategy(lighthouse_outage_timeout=None).settings.lighthouse_outage_timeout is None
    for bad in (0, -5, "10"):
        with pytest.raises(FTConfigError, match="lighthouse_outage_timeout"):
            FTStrategy(lighthouse_outage_timeout=bad)


def test_the_probe_tells_a_listening_port_from_a_closed_one():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        assert lighthouse_reachable(url)
    assert not lighthouse_reachable(url)


# ---------------------------------------------------------------------------------------------------- real processes
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LighthouseProcess:
    """``lightning-ft lighthouse`` as a process of its own, on a fixed port, that the test kills and restarts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def spawn(self) -> None:
        """Start one; :meth:`wait_listening` waits until it accepts connections."""
        self.starts += 1
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lightning_ft_cli",
                    "lighthouse",
                    f"--bind=127.0.0.1:{self.port}",
                    # The launcher's local values: a dead group is noticed in a second, stragglers waited for 10 s.
                    f"--join-timeout-ms={JOIN_TIMEOUT_S * 1000:.0f}",
                    "--heartbeat-timeout-ms=1000",
                ],
                cwd=REPO,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )

    @property
    def log_path(self) -> Path:
        return self.root / f"lighthouse{self.starts}.log"

    def wait_listening(self, timeout: float = 180.0) -> float:
        """Wait until the latest one accepts connections; returns when it did (``time.time()``)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not lighthouse_reachable(self.url, timeout=0.5):
            if self.process.poll() is not None:
                raise AssertionError(f"lighthouse exited ({self.process.returncode}):\n{self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"lighthouse not listening after {timeout}s:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        return time.time()

    def kill(self) -> float:
        """SIGKILL it by PID and wait until it is gone. Returns when it was killed (``time.time()``)."""
        assert self.process is not None
        killed_at = time.time()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        return killed_at

    def stop(self) -> None:
        """Stop the one we started last, if it still runs (the earlier one was killed and reaped)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[LighthouseProcess]:
    lighthouse = LighthouseProcess(tmp_path)
    try:
        yield lighthouse
    finally:
        lighthouse.stop()


def committed_together(job: LaunchedJob, group: int, after: float = 0.0) -> list[dict[str, Any]]:
    return [e for e in job.events("step", group=group, committed=True, participants=2) if e["time"] > after]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_training_stalls_while_the_lighthouse_is_down_and_resumes_when_it_is_back(launch, lighthouse):
    """Two groups train against a lighthouse of their own; it is SIGKILLed after a few joint commits. Both groups
    report the stall, nobody crashes; a new lighthouse on the same port lets them rejoin in one quorum at the step
    where they stopped (no heal), and the job ends at max_steps with bit-identical replicas.

    The quorum requests in flight at the kill are never answered by torchft's ManagerServer; without the rescue
    (``lighthouse_outage``) each ran out ``quorum_timeout`` before the groups asked again. Here ``quorum_timeout`` is
    120 s, and training must resume within a bound of the settings that does not involve it: the rejoin grace, two
    probe intervals (noticing the return, then the rescue's turn), the lighthouse's join timeout and 10 s for a busy
    machine."""
    run_lighthouse_restart(launch, lighthouse, nproc=1, worker_args=[], quorum_timeout=120.0)


@pytest.mark.multiprocess
@pytest.mark.paths
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "nproc, worker_args, quorum_timeout, down_longer",
    [
        pytest.param(2, ["--async-quorum=0"], 120.0, False, id="synchronous-quorum-2-processes-per-group"),
        pytest.param(1, [], 10.0, True, id="down-longer-than-quorum-timeout"),
        # LocalSGD's quorum is at its syncs: the join sync, then every 4 steps (32 steps: the Manager counts 1 + 8
        # syncs, and the last step is a sync, after which the replicas are identical)
        pytest.param(1, ["--algorithm=local_sgd", "--sync-every=4"], 120.0, False, id="local-sgd-quorum-at-the-sync"),
    ],
)
def test_a_lighthouse_restart_on_other_paths(
    launch, lighthouse, nproc: int, worker_args: list[str], quorum_timeout: float, down_longer: bool
):
    """The same outage with a synchronous quorum in groups of two processes (every rank's request hangs, every rank
    rescues its own), with the lighthouse down for longer than ``quorum_timeout`` (the hanging requests time out
    first; the groups ask again once it is back), and under LocalSGD (the groups train on locally until their next
    sync, whose quorum stalls). ``make test-extra``."""
    local_sgd = "--algorithm=local_sgd" in worker_args
    run_lighthouse_restart(
        launch,
        lighthouse,
        nproc=nproc,
        worker_args=worker_args,
        quorum_timeout=quorum_timeout,
        down_longer=down_longer,
        max_steps=32 if local_sgd else 30,
        manager_steps=9 if local_sgd else None,
        held_at_the_kill=local_sgd,
    )


def run_lighthouse_restart(
    launch: Any,
    lighthouse: LighthouseProcess,
    *,
    nproc: int,
    worker_args: list[str],
    quorum_timeout: float,
    down_longer: bool = False,
    max_steps: int = 30,
    manager_steps: int | None = None,
    held_at_the_kill: bool = False,
) -> None:
    """``held_at_the_kill``: both groups stop at global step :data:`HELD_AT_STEP`, between two syncs of
    ``--sync-every=4`` (after the third), before the lighthouse dies, so that no quorum answer is on its way when it
    does. Otherwise the kill may land while the lighthouse answers a quorum, reaching one group and not the other: per
    step, the group that got it fails its step after ``timeout`` and asks again beside the other; under LocalSGD it
    fails the sync and trains on to its next one, a sync period ahead of the other group, which can then end the job
    alone (a limit of semi-synchronous training under a lighthouse outage, docs/failure-semantics.md)."""
    manager_steps = max_steps if manager_steps is None else manager_steps
    bound = REJOIN_GRACE_S + 2 * PROBE_INTERVAL_S + JOIN_TIMEOUT_S + 10.0
    assert down_longer or bound < quorum_timeout / 2, "the bound must tell a rescue from a request that timed out"
    lighthouse.spawn()  # both start up meanwhile; a Manager retries connecting for connect_timeout (30 s)
    job = launch(
        groups=2,
        nproc_per_group=nproc,
        worker_args=[f"--max-steps={max_steps}", f"--quorum-timeout={quorum_timeout:g}", *worker_args, *GATES],
        launcher_args=["--lighthouse", lighthouse.url],
    )
    lighthouse.wait_listening()
    # Written before training starts: a hold written later could come after a group passed the step.
    holds = [job.hold_from_step(g, HELD_AT_STEP, cycle=SYNC_CYCLE) for g in (0, 1)] if held_at_the_kill else []
    start_together(job, groups=2, nproc=nproc)
    job.wait_for(
        "both groups to commit 3 steps together", lambda: all(len(committed_together(job, g)) >= 3 for g in (0, 1))
    )
    ranks = {(g, r) for g in (0, 1) for r in range(nproc)}
    if held_at_the_kill:
        job.wait_for(
            "both groups to stop at the same step between two syncs",
            lambda: all(job.events("paused", group=g, phase="from_step") for g in (0, 1)),
        )
        held = job.events("paused", phase="from_step")
        assert {e["step"] for e in held} == {HELD_AT_STEP}, held
        killed_at = lighthouse.kill()
        for hold in holds:
            hold.unlink()
    else:
        pauses = [job.root / f"pause.group{group}" for group in (0, 1)]
        for pause in pauses:  # at most one more step each: the job cannot finish before the lighthouse is gone
            pause.touch()
        killed_at = lighthouse.kill()
        for pause in pauses:
            pause.unlink()
    stalls = job.wait_for(
        "every rank to report the stall",
        lambda: (found := job.events("lighthouse_unreachable")) and {(e["group"], e["rank"]) for e in found} == ranks
        and found,
    )  # fmt: skip
    stalled_steps = {e["step"] for e in stalls}
    assert len(stalled_steps) == 1, f"the ranks stalled at different committed steps: {stalls}"
    (stalled_at,) = stalled_steps
    assert all(e["lighthouse"] == lighthouse.url for e in stalls), stalls
    assert not [e for e in job.events("step", committed=True) if e["time"] > max(s["time"] for s in stalls)], (
        "a step committed while the lighthouse was down"
    )
    if down_longer:  # the scenario: an outage that outlasts every request pending at the kill
        time.sleep(max(0.0, killed_at + quorum_timeout + 2.0 - time.time()))

    lighthouse.spawn()
    restarted_at = lighthouse.wait_listening()
    assert job.wait_exit() == 0, job.tail()

    states = job.final_states()
    assert sorted(states) == sorted(ranks), sorted(states)
    for key, state in states.items():
        assert state["global_step"] == max_steps, f"{key}: global_step {state['global_step']} != {max_steps}"
        assert state["manager_step"] == manager_steps, f"{key}: manager step {state['manager_step']}"
    if manager_steps == max_steps:
        assert_bit_identical(states, replicas=len(ranks))
    else:  # semi-synchronous: each group keeps its own inner optimizer state; parameters and schedules are shared
        first = states[min(states)]
        for key, state in states.items():
            for name in ("model", "lr_schedulers", "lrs"):
                assert_tree_equal(first[name], state[name], f"{key} {name}")
    for group, rank in sorted(ranks):
        restarts = [e for e in job.events("started", group=group, rank=rank) if e["time"] > killed_at]
        assert not restarts, f"group {group} rank {rank} restarted instead of riding the outage out"
        assert [e["step"] for e in job.events("lighthouse_back", group=group, rank=rank)] == [stalled_at]
        assert job.events("lighthouse_reachable", group=group, rank=rank), f"{group}/{rank}: no lighthouse return"
        resumed = [e for e in committed_together(job, group, after=restarted_at) if e["rank"] == rank]
        assert resumed, f"group {group} rank {rank} committed nothing together after the lighthouse restart"
        assert resumed[0]["step"] == stalled_at + 1, (resumed[0], stalled_at)
        resumed_after = resumed[0]["time"] - restarted_at
        assert resumed_after < bound, f"group {group} resumed {resumed_after:.1f}s after the lighthouse was back"
    assert not [e for e in job.events("healed") if e["time"] > killed_at], "a group had to heal"
    assert "is unreachable; training is stalled" in job.log_path.read_text(errors="replace")
    drawn = report.summary(load_timeline(job.events_dir))  # `lightning-ft report` shows the stall
    assert drawn.count(f"stalls: step {stalled_at} (lighthouse outage, ") == 2, drawn
    report_figures(job, killed_at, restarted_at, {g: stalled_at for g in (0, 1)})


def report_figures(job: LaunchedJob, killed_at: float, restarted_at: float, stalled_at: dict[int, int]) -> None:
    """Print (never assert) how long the outage cost: measured on a loaded 2-core machine, for the docs."""
    first_commit = min(e["time"] for e in job.events("step", committed=True) if e["time"] > restarted_at)
    uncommitted = len(job.events("step", committed=False))
    back = job.events("lighthouse_back")
    print(
        f"\nlighthouse outage: killed at committed steps {stalled_at}; new lighthouse listening "
        f"{restarted_at - killed_at:.1f}s after the kill; first commit {first_commit - restarted_at:.1f}s after it "
        f"was listening; stall reported per group {[round(e['stalled_s'], 1) for e in back]}s; "
        f"uncommitted step attempts: {uncommitted}"
    )
    write(
        {
            "case": "Lighthouse SIGKILLed, restarted at the same address",
            "identical": True,
            "steps_lost": uncommitted,
            "stall_s": round(first_commit - killed_at, 2),
            "resumed_after_new_lighthouse_listens_s": round(first_commit - restarted_at, 2),
        }
    )

"""One group id, one group (:mod:`lightning_ft.manager.group_claim`).

Unit tests drive :class:`GroupClaimCheck` with a scripted client and status page. The real-process test starts a job
of two groups against one lighthouse, then a second launch that also says it is group 0 (a copy-paste in a job spec):
the newcomer stops at its first quorum with the error; the job ends as one model
at the exact step count, and no committed step trained two contributions on the same samples.
"""

from __future__ import annotations

import re
import socket
from collections import defaultdict
from typing import Any

import pytest
from harness import assert_bit_identical, launch_job
from test_exactly_once import committed_contributions
from test_fault_tolerance import GATES

from lightning_ft import DuplicateReplicaGroupError
from lightning_ft.manager.group_claim import Claimant, GroupClaimCheck, keeper_of
from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable, read_status_page

LIGHTHOUSE = "http://127.0.0.1:29510"
ME, TWIN, PEER = "lightning_ft_00000:bbb", "lightning_ft_00000:aaa", "lightning_ft_00001:ccc"


class Quorum:
    def __init__(self, *replica_ids: str) -> None:
        self.replica_ids = list(replica_ids)


class Client:
    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum

    def _quorum(self, **request: Any) -> Quorum:
        return self.quorum


def status(steps: dict[str, int], ages: dict[str, float]) -> LighthouseStatus:
    return LighthouseStatus(
        quorum_id=2,
        previous_quorum=steps,
        heartbeats={rid: age < 5 for rid, age in ages.items()},
        member_addresses={rid: f"http://host-{rid[-3:]}:1" for rid in steps},
        heartbeat_ages=ages,
    )


def check(quorum: Quorum, pages: list[Any]) -> tuple[GroupClaimCheck, list[float]]:
    slept: list[float] = []

    def read(url: str) -> LighthouseStatus:
        page = pages.pop(0)
        if isinstance(page, BaseException):
            raise page
        return page

    return GroupClaimCheck(Client(quorum), LIGHTHOUSE, ME, read_status=read, sleep=slept.append), slept


def test_the_keeper_is_the_claimant_furthest_ahead_then_the_first_replica_id():
    assert keeper_of([Claimant(ME, 0, None), Claimant(TWIN, 12, None)]).replica_id == TWIN
    assert keeper_of([Claimant(ME, 12, None), Claimant(TWIN, 3, None)]).replica_id == ME  # a cut-off old lifetime
    assert keeper_of([Claimant(ME, 5, None), Claimant(TWIN, 5, None)]).replica_id == TWIN  # "aaa" sorts first
    assert keeper_of([Claimant(ME, 5, None), Claimant(TWIN, None, None)]).replica_id == ME


def test_a_quorum_without_a_twin_passes_without_reading_the_status_page():
    quorum = Quorum(ME, PEER)
    claim, slept = check(quorum, [])
    assert claim._quorum(step=3) is quorum and slept == []


def test_the_newcomer_stops_naming_the_id_both_hosts_and_the_fix():
    steps, ages = {ME: 0, TWIN: 40, PEER: 40}, {ME: 0.1, TWIN: 0.1, PEER: 0.1}
    claim, slept = check(Quorum(TWIN, ME, PEER), [status(steps, ages), status(steps, ages)])
    with pytest.raises(DuplicateReplicaGroupError) as raised:
        claim._quorum(step=0)
    message = str(raised.value)
    assert "group id lightning_ft_00000" in message and "host-aaa" in message and "host-bbb" in message
    assert "committed step 40, this one 0" in message and "--group-ids" in message
    assert slept == [claim._liveness_wait], "stopped without checking that the keeper is alive"


def test_the_keeper_goes_on():
    steps, ages = {ME: 40, TWIN: 0, PEER: 40}, {ME: 0.1, TWIN: 0.1, PEER: 0.1}
    quorum = Quorum(TWIN, ME, PEER)
    claim, slept = check(quorum, [status(steps, ages)])
    assert claim._quorum(step=40) is quorum and slept == []


def test_a_restart_whose_old_lifetime_is_dead_is_never_refused():
    """The old lifetime (ahead, its quorum request still counted) stopped heartbeating: the restart goes on."""
    steps = {ME: 0, TWIN: 40, PEER: 40}
    first, again = status(steps, {ME: 0.1, TWIN: 1.2, PEER: 0.1}), status(steps, {ME: 0.1, TWIN: 4.2, PEER: 0.1})
    quorum = Quorum(TWIN, ME, PEER)
    claim, _ = check(quorum, [first, again])
    assert claim._quorum(step=0) is quorum


def test_an_unreadable_status_page_stops_nobody():
    quorum = Quorum(TWIN, ME)
    claim, _ = check(quorum, [StatusPageUnreadable("another torchft")])
    assert claim._quorum(step=0) is quorum


# ---------------------------------------------------------------------------------------------------- real processes
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def twin_request_held(port: int) -> bool:
    """Whether the lighthouse's next quorum has a participant (its status page: ``[k/n participants healthy]``)."""
    try:
        page = read_status_page(f"http://127.0.0.1:{port}")
    except StatusPageUnreadable:
        return False
    found = re.search(r"\[(\d+)/(\d+) participants healthy\]", page)
    return found is not None and int(found.group(1)) >= 1


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_second_launch_claiming_a_live_groups_id_stops_and_the_job_ends_as_one_model(tmp_path):
    max_steps, samples = 40, 4096
    port = free_port()
    root = tmp_path / "job"
    worker_args = [f"--max-steps={max_steps}", f"--index-data={samples}", "--async-quorum=0", *GATES]
    job = launch_job(root, groups=2, worker_args=worker_args, launcher_args=[f"--lighthouse-bind=127.0.0.1:{port}"])
    twin = None
    try:
        job.wait_for("both groups to start", lambda: job.worker_pid(0, 0) and job.worker_pid(1, 0))
        holds = [job.hold_from_step(group, 5) for group in (0, 1)]  # the job must not end before the twin is there
        (root / "go").touch()
        job.wait_for("group 0 to commit 5 steps", lambda: len(job.committed_steps(0)) >= 5)
        keeper_pid = job.worker_pid(0, 0)
        twin = launch_job(
            root,
            groups=2,
            worker_args=worker_args,
            max_restarts=0,
            launcher_args=[f"--lighthouse=http://127.0.0.1:{port}", "--group-ids=0"],
            log_name="twin.log",
        )
        # While both groups are held, the only quorum request the lighthouse can hold is the twin's; it cannot form
        # a quorum alone (a majority of the 3 heartbeating replicas must ask), so the groups' next one includes it.
        job.wait_for("the lighthouse to hold the twin's quorum request", lambda: twin_request_held(port))
        # The groups go on to step 7 and wait there (the same gate files, rewritten), so that their first quorum
        # meets the twin's and the job cannot end while the twin checks that the keeper is alive.
        holds = [job.hold_from_step(group, 7) for group in (0, 1)]
        job.wait_for("the twin to stop", lambda: job.events("duplicate_group", kept=False))
        for hold in holds:
            hold.unlink()
        assert twin.wait_exit() != 0, twin.tail()
        assert job.wait_exit() == 0, job.tail()
    finally:
        job.stop()
        if twin is not None:
            twin.stop()

    log = twin.log_path.read_text(errors="replace")
    assert "DuplicateReplicaGroupError" in log, twin.tail()
    assert "group id lightning_ft_00000 is held by another live process group" in log, twin.tail()
    assert "this one" in log and "stops before it trains" in log and "--group-ids" in log
    twins = {e["pid"] for e in job.events("started", group=0)} - {keeper_pid}
    assert len(twins) == 1, f"one twin lifetime: {twins}"
    assert {e["pid"] for e in job.events("duplicate_group", kept=True)} == {keeper_pid}
    assert not [e for e in job.events("step", group=0, committed=True) if e["pid"] in twins], "the twin trained"
    assert {e["pid"] for e in job.events("duplicate_group", kept=False)} == twins

    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0)], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, (key, state["global_step"])
    assert_bit_identical(states, replicas=2)
    by_step: dict[tuple[int, int], list[list[int]]] = defaultdict(list)
    for record in committed_contributions(job):
        by_step[(record["vote_step"], record["quorum_id"])].append(record["ids"])
    for step, contributions in by_step.items():
        ids = [i for contribution in contributions for i in contribution]
        assert len(ids) == len(set(ids)), f"step {step} trained a sample twice: {contributions}"

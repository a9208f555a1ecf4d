"""A one-process group's commit vote is answered in process; every other request still reaches torchft."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_ft import FTStrategy
from lightning_ft.manager.builder import composed_client
from lightning_ft.manager.lighthouse_outage import OutageTolerantClient
from lightning_ft.manager.local_vote import LocalCommitVote
from lightning_ft.manager.quorum_members import QuorumMembers, quorum_groups
from lightning_ft.manager.vote_inputs import VoteInputs, should_commit_reading


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        self.calls.append("should_commit")
        return should_commit

    def _quorum(self, **request: object) -> str:
        self.calls.append("quorum")
        return "quorum"


@pytest.mark.parametrize("vote", [True, False])
def test_the_vote_of_a_one_process_group_is_its_own_without_an_rpc(vote):
    client = RecordingClient()
    local = LocalCommitVote(client)
    assert local.should_commit(0, 7, vote, timeout=timedelta(seconds=1)) is vote
    assert client.calls == []
    assert local._quorum(step=7) == "quorum"  # the quorum still goes to the ManagerServer and the lighthouse
    assert client.calls == ["quorum"]


def test_a_group_of_several_processes_keeps_torchfts_vote():
    settings = FTStrategy(replica_group_id=0, num_replica_groups=1).settings
    base = RecordingClient()
    one, outage = composed_client(base, settings, group_world_size=1)
    several, _ = composed_client(base, settings, group_world_size=2)
    assert isinstance(one, VoteInputs) and isinstance(one._client, QuorumMembers)
    assert isinstance(one._client._client, LocalCommitVote)
    assert outage is None  # an embedded lighthouse: no outage to ride out
    assert isinstance(several, VoteInputs) and several._client._client is base
    with pytest.raises(ValueError, match="group rank 1"):
        one.should_commit(1, 0, True, timedelta(seconds=1))


def test_the_client_is_composed_once_outage_tolerance_inside_the_local_vote():
    """With an external lighthouse, quorum requests ride out its outages; the local vote wraps that client, so the
    vote never waits on the lighthouse and a quorum request passes through both."""
    settings = FTStrategy(replica_group_id=0, num_replica_groups=2, lighthouse="http://127.0.0.1:1").settings
    base = RecordingClient()
    client, outage = composed_client(base, settings, group_world_size=1)
    try:
        assert isinstance(client, VoteInputs) and isinstance(outage, OutageTolerantClient)
        local = client._client._client
        assert isinstance(local, LocalCommitVote) and local._client is outage
        assert client.should_commit(0, 3, True, timedelta(seconds=1)) is True and base.calls == []
    finally:
        assert outage is not None
        outage.shutdown()


def test_every_quorum_answer_passes_through_and_its_members_are_remembered():
    """The job's last step needs the latest quorum's members (lightning_ft.start.last_step); only this job's count."""

    class Answer:
        replica_ids = ["job_0002:a", "other_0001:b", "job_0000:c"]

    class Answering(RecordingClient):
        def _quorum(self, **request: object) -> type[Answer]:  # type: ignore[override]
            return Answer

    class Manager:
        _client = VoteInputs(QuorumMembers(Answering()))

    assert quorum_groups(Manager, "job_") is None  # no quorum yet
    assert Manager._client._quorum(step=3) is Answer
    assert quorum_groups(Manager, "job_") == {0, 2}


class VotingManager:
    """A Manager as far as :func:`should_commit_reading` sees it: torchft's vote syncs the device (logged), then asks
    its client."""

    def __init__(self, client: object, log: list[str]) -> None:
        self._client = client
        self.log = log
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error

    def should_commit(self) -> bool:
        self.log.append("device sync")
        return self._client.should_commit(0, 5, self.error is None, timedelta(seconds=1))


@pytest.mark.parametrize("reader_says", [True, False])
def test_the_processs_own_vote_inputs_are_read_after_torchfts_sync_and_only_for_the_next_vote(reader_says):
    log: list[str] = []
    inputs = VoteInputs(LocalCommitVote(RecordingClient()))
    manager = VotingManager(inputs, log)

    def reader(voting_to_commit: bool) -> bool:
        log.append(f"read (voting {voting_to_commit})")
        return voting_to_commit and reader_says

    assert should_commit_reading(manager, reader) is reader_says  # type: ignore[arg-type]
    assert log == ["device sync", "read (voting True)"]
    assert manager.should_commit() is True and log[-1] == "device sync", "the reader served one vote only"


def test_a_manager_built_without_the_wrapper_reads_before_its_vote():
    """A stand-in Manager (no VoteInputs client): still a correct vote, at the price of the read's own sync."""
    log: list[str] = []
    manager = VotingManager(LocalCommitVote(RecordingClient()), log)
    assert should_commit_reading(manager, lambda vote: log.append("read") is None and vote) is True  # type: ignore[arg-type]
    assert log == ["read", "device sync"]


@pytest.mark.parametrize("torchft_says", [True, False])
def test_the_vote_check_runs_at_every_vote_whatever_the_vote_and_its_no_is_final(torchft_says):
    """Every rank must make the check (it broadcasts in the group), even one whose vote is already no; its no wins,
    and the one-shot reader sees the combined vote."""
    log: list[str] = []
    inputs = VoteInputs(LocalCommitVote(RecordingClient()))
    says = iter([True, False])
    inputs.check_each_vote(lambda: log.append("check") is None and next(says))
    inputs.read_at_next_vote(lambda vote: log.append(f"read (voting {vote})") is None and vote)
    timeout = timedelta(seconds=1)
    assert inputs.should_commit(0, 5, torchft_says, timeout) is torchft_says
    assert inputs.should_commit(0, 5, torchft_says, timeout) is False
    assert log == ["check", f"read (voting {torchft_says})", "check"]

"""A one-process group's commit vote is answered in process; every other request still reaches torchft."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_ft.manager.local_vote import LocalCommitVote, vote_locally


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        self.calls.append("should_commit")
        return should_commit

    def _quorum(self, **request: object) -> str:
        self.calls.append("quorum")
        return "quorum"


class FakeManager:
    def __init__(self) -> None:
        self._client = RecordingClient()


@pytest.mark.parametrize("vote", [True, False])
def test_the_vote_of_a_one_process_group_is_its_own_without_an_rpc(vote):
    client = RecordingClient()
    local = LocalCommitVote(client)
    assert local.should_commit(0, 7, vote, timeout=timedelta(seconds=1)) is vote
    assert client.calls == []
    assert local._quorum(step=7) == "quorum"  # the quorum still goes to the ManagerServer and the lighthouse
    assert client.calls == ["quorum"]


def test_a_group_of_several_processes_keeps_torchfts_vote():
    one, several = FakeManager(), FakeManager()
    assert vote_locally(one, group_world_size=1)
    assert not vote_locally(several, group_world_size=2)
    assert isinstance(one._client, LocalCommitVote)
    assert isinstance(several._client, RecordingClient)
    with pytest.raises(ValueError, match="group rank 1"):
        one._client.should_commit(1, 0, True, timedelta(seconds=1))

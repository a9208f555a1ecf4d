"""The commit vote of a one-process replica group, taken in process instead of over an RPC.

torchft's ``Manager.should_commit`` asks the group's ManagerServer to combine the votes of every rank of the group:
the server counts one vote per group rank and answers all of them with "commit" when none said no. The vote never
leaves the group (different groups may decide differently; a group that does not commit heals at its next quorum).
In a group of one process that RPC combines one vote with nothing: its answer is the vote itself. It is still a gRPC
round trip on the training thread's critical path at every step, plus the server's work: on a small model, the
largest single per-step cost of fault tolerance (``docs/benchmarks.md``).

:class:`LocalCommitVote` wraps the Manager's client (installed by :func:`lightning_ft.manager.builder.composed_client`
when the group has one process) and answers the vote itself; every other request passes through unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_ft.errors import UnsupportedArgumentError


class LocalCommitVote:
    """The Manager's client, answering ``should_commit`` without the RPC; for a group of exactly one process."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """The group's decision: with one rank, that rank's vote."""
        if group_rank != 0:
            raise UnsupportedArgumentError(
                f"LocalCommitVote serves a group of one process, but was asked by group rank {group_rank}"
            )
        return should_commit

"""Which replica groups the latest quorum holds, as the lighthouse answered it.

torchft's quorum answer lists its members' replica ids (``QuorumResult.replica_ids``), but the Manager keeps only
this group's rank among them and their number. The job's last step needs the members themselves: a group outside the
quorum may already have ended the job (:mod:`lightning_ft.start.last_step`). :class:`QuorumMembers` wraps the
Manager's client (:func:`lightning_ft.manager.builder.composed_client`) and remembers the replica ids of every quorum
answer; every request passes through unchanged.
"""

from __future__ import annotations

from typing import Any

from torchft import Manager

from lightning_ft.manager.internals import manager_client
from lightning_ft.manager.lighthouse_status import group_of


class QuorumMembers:
    """The Manager's client, remembering the replica ids of the latest quorum answer."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.quorum_replica_ids: tuple[str, ...] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.quorum_replica_ids = tuple(quorum.replica_ids)
        return quorum


def quorum_groups(manager: Manager, prefix: str) -> set[int] | None:
    """The groups of this job in the Manager's latest quorum, or None when it is unknown (a Manager whose client
    lightning-ft did not wrap, or no quorum yet)."""
    replica_ids = getattr(manager_client(manager), "quorum_replica_ids", None)
    if replica_ids is None:
        return None
    groups = (group_of(replica_id, prefix) for replica_id in replica_ids)
    return {group for group in groups if group is not None}

"""One group id, one group: a second live process group that claims a group id is stopped at its first quorum.

torchft appends a fresh uuid to every process lifetime's replica id, so the lighthouse takes two launches of "group 0"
(a copy-paste in a job spec, or a replacement started while the old group still lives behind a partition) for two
members. Both would train as group 0, on the same samples, and both would write checkpoints.

Every quorum answer lists its members' replica ids. When this group's id (``<prefix><group>``, before the ``:``)
appears more than once, the members that claim it settle which one keeps it, from the lighthouse's status page
(:mod:`lightning_ft.manager.lighthouse_status`), which shows every member's committed step and Manager address and how
long ago each replica last heartbeated:

* **The one furthest ahead keeps the id**: a replacement that has just joined (step 0, about to heal) stops, and so
  does an old group that was cut off and comes back behind the replacement that trained on in its place.
* **At the same step** (two launches started together), the one whose replica id sorts first keeps it: both sides
  compute the same answer from the same page, so exactly one stops.
* **The one that stops checks that the keeper is alive** first: it waits :data:`LIVENESS_WAIT_S` and reads the page
  again, and stops only if the keeper heartbeated meanwhile. A legitimate restart whose old lifetime is really dead
  (its quorum request may still be counted for one quorum, while its last heartbeat ages) is never refused.
* It stops before it trains: the check runs inside the quorum request, before torchft uses the quorum. The keeper's
  step with the one that stops fails like any step with a member that went away, and is taken again without it.

A page that cannot be read (another torchft release) stops nobody: the duplicate is logged and training goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable, read_lighthouse_status
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

# How long the member that is to stop waits before it checks that the keeper is alive. torchft heartbeats every
# 100 ms by default; a keeper whose last heartbeat is older than this when the page is read again is taken for dead.
LIVENESS_WAIT_S = 3.0


class DuplicateReplicaGroupError(LightningFTError, RuntimeError):
    """Another live process group holds this group's id; this one stops before it trains."""


@dataclass(frozen=True)
class Claimant:
    """One member of a quorum that claims this group's id."""

    replica_id: str  # the lifetime's id: ``<prefix><group>:<uuid>``
    step: int | None  # its committed step, from the status page (None: not on it)
    address: str | None  # its Manager's address, from the status page

    @property
    def host(self) -> str:
        return self.address or "an unknown host"


def keeper_of(claimants: Sequence[Claimant]) -> Claimant:
    """The claimant that keeps the group id: the highest committed step, then the replica id that sorts first."""
    return min(
        claimants, key=lambda claimant: (-(claimant.step if claimant.step is not None else -1), claimant.replica_id)
    )


class GroupClaimCheck:
    """Wraps the Manager's client: each quorum answer is checked for another lifetime claiming this group's id.

    Args:
        client: The client to wrap.
        lighthouse: The lighthouse URL (its status page is read only when a duplicate shows up).
        replica_id: This process lifetime's replica id, as torchft registered it (with its uuid).
        read_status: The status page reader (replaceable in tests).
        sleep: The sleep (replaceable in tests).
        liveness_wait: Seconds to wait before checking that the keeper is alive.
    """

    def __init__(
        self,
        client: Any,
        lighthouse: str,
        replica_id: str,
        read_status: Callable[[str], LighthouseStatus] = read_lighthouse_status,
        sleep: Callable[[float], None] = time.sleep,
        liveness_wait: float = LIVENESS_WAIT_S,
    ) -> None:
        self._client = client
        self._lighthouse = lighthouse
        self._replica_id = replica_id
        self._group_name = replica_id.split(":", 1)[0]
        self._read_status = read_status
        self._sleep = sleep
        self._liveness_wait = liveness_wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **request: Any) -> Any:
        result = self._client._quorum(**request)
        claims = [rid for rid in result.replica_ids if rid.split(":", 1)[0] == self._group_name]
        if len(claims) > 1:
            self._settle(claims, request.get("step"))
        return result

    def _settle(self, claims: list[str], step: int | None) -> None:
        """Return if this lifetime keeps the group id (or cannot tell); raise if another live one does."""
        status = self._status()
        if status is None:
            log.warning(
                "lightning-ft: group id %s is claimed by %d members of this quorum (%s); the lighthouse's status page "
                "could not be read to settle which one keeps it, so training goes on. Give every launch its own "
                "group id.",
                self._group_name,
                len(claims),
                ", ".join(claims),
            )
            return
        claimants = [
            Claimant(rid, step if rid == self._replica_id else status.previous_quorum.get(rid),
                     status.member_addresses.get(rid))
            for rid in claims
        ]  # fmt: skip
        keeper = keeper_of(claimants)
        me = next(claimant for claimant in claimants if claimant.replica_id == self._replica_id)
        others = [claimant for claimant in claimants if claimant is not me]
        if keeper is me:
            log.warning(
                "lightning-ft: group id %s is also claimed by %s; this group (step %s) keeps it and the other stops.",
                self._group_name,
                ", ".join(f"{other.replica_id} at {other.host} (step {other.step})" for other in others),
                step,
            )
            events.emit("duplicate_group", group_id=self._group_name, kept=True, others=[o.replica_id for o in others])
            return
        self._sleep(self._liveness_wait)
        again = self._status()
        age = None if again is None else again.heartbeat_ages.get(keeper.replica_id)
        if age is None or age >= self._liveness_wait:
            log.warning(
                "lightning-ft: group id %s was also claimed by %s, whose heartbeat has stopped (a lifetime that "
                "ended); this group goes on.",
                self._group_name,
                keeper.replica_id,
            )
            return
        events.emit("duplicate_group", group_id=self._group_name, kept=False, others=[o.replica_id for o in others])
        why = (
            f"it is ahead (committed step {keeper.step}, this one {step})"
            if keeper.step != step
            else f"both are at committed step {step}, and its replica id sorts first"
        )
        raise DuplicateReplicaGroupError(
            f"lightning-ft: group id {self._group_name} is held by another live process group: {keeper.replica_id} at "
            f"{keeper.host}; this one ({self._replica_id} at {me.host}) stops before it trains, because {why}. Two "
            f"groups with one id would train on the same samples and both write checkpoints. To fix: give every "
            f"launch its own group id (`lightning-ft launch --group-ids`, or REPLICA_GROUP_ID / "
            f"FTStrategy(replica_group_id=...)), and stop an old group before starting its replacement."
        )

    def _status(self) -> LighthouseStatus | None:
        try:
            return self._read_status(self._lighthouse)
        except StatusPageUnreadable as error:
            log.debug("lightning-ft: %s", error)
            return None

"""What the lighthouse knows about a job, read from its status page without joining a quorum.

torchft 0.2.0's lighthouse has no RPC that reads its state without changing it (a heartbeat registers a replica, a
quorum request joins one). Its status page (``GET /status``, what its own dashboard polls) shows three things a
group needs before it trains: the current quorum id, the members of the last quorum with their committed steps, and
every replica it has heard from, each marked fresh or ``old`` (no heartbeat within the lighthouse's heartbeat
timeout). This module is the one place that reads that page; every caller must cope with
:class:`StatusPageUnreadable` (another torchft release may change the page), by falling back to what it would do
without the information.

A replica id is the group's id (``FTSettings.replica_id``: prefix and zero-padded group number) followed by
``:<uuid>``, a new uuid for every process lifetime, so the page tells a group's new lifetime from its dead one.
"""

from __future__ import annotations

import http.client
import re
import urllib.request
from dataclasses import dataclass, field

from lightning_ft.errors import LightningFTError

STATUS_TIMEOUT_S = 2.0

_QUORUM_ID = re.compile(r"Current quorum_id:\s*(\d+)")
_PREVIOUS = re.compile(r"<h3>Previous Quorum</h3>(.*?)<h2>Heartbeats</h2>", re.S)
_PREVIOUS_ID = re.compile(r"Previous quorum id:\s*(\d+)")
_MEMBER = re.compile(
    r'<div class="member[^"]*">\s*<b>([^<]+)</b>.*?Step:\s*(\d+)(?:\s*<br/?>\s*Manager:\s*([^\s<]+))?', re.S
)
_HEARTBEAT = re.compile(r'<li class="heartbeat([^"]*)">\s*([^\s<]+): seen(?:\s*([0-9.eE+-]+)s ago)?', re.S)


class StatusPageUnreadable(LightningFTError, RuntimeError):
    """The lighthouse's status page could not be fetched, or it is not in the form expected."""


@dataclass(frozen=True)
class LighthouseStatus:
    """One reading of the lighthouse: its current quorum id, the last quorum's members (replica id → committed
    step) and the replicas it has heard from (replica id → whether the heartbeat is fresh)."""

    quorum_id: int
    previous_quorum: dict[str, int] = field(default_factory=dict)
    heartbeats: dict[str, bool] = field(default_factory=dict)
    previous_quorum_id: int | None = None
    member_addresses: dict[str, str] = field(default_factory=dict)  # the last quorum's members' Manager addresses
    heartbeat_ages: dict[str, float] = field(default_factory=dict)  # seconds since each replica's last heartbeat

    def fresh_groups(self, prefix: str) -> set[int]:
        """The groups of this job (replica ids starting with ``prefix``) with a fresh heartbeat."""
        groups = (group_of(replica, prefix) for replica, fresh in self.heartbeats.items() if fresh)
        return {group for group in groups if group is not None}

    def live_member_steps(self, prefix: str, exclude_group: int) -> list[int]:
        """Committed steps of the last quorum's members of this job that still heartbeat, other groups only."""
        return [
            step
            for replica, step in self.previous_quorum.items()
            if self.heartbeats.get(replica) and group_of(replica, prefix) not in (None, exclude_group)
        ]

    def has_members_of(self, prefix: str) -> bool:
        """Whether the last quorum had members of this job, alive or not: the job has trained before."""
        return any(group_of(replica, prefix) is not None for replica in self.previous_quorum)


def group_of(replica_id: str, prefix: str) -> int | None:
    """The group number of ``<prefix><digits>[:uuid]``, or None for a replica of another job."""
    name = replica_id.split(":", 1)[0]
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


def parse_status_page(page: str) -> LighthouseStatus:
    match = _QUORUM_ID.search(page)
    if match is None:
        raise StatusPageUnreadable("the status page has no 'Current quorum_id: N' line")
    previous = _PREVIOUS.search(page)
    found = _MEMBER.findall(previous.group(1)) if previous else []
    members = {name.strip(): int(step) for name, step, _ in found}
    addresses = {name.strip(): address for name, _, address in found if address}
    beats = _HEARTBEAT.findall(page)
    previous_id = _PREVIOUS_ID.search(page)
    return LighthouseStatus(
        quorum_id=int(match.group(1)),
        previous_quorum=members,
        heartbeats={replica: "old" not in classes for classes, replica, _ in beats},
        previous_quorum_id=int(previous_id.group(1)) if previous_id else None,
        member_addresses=addresses,
        heartbeat_ages={replica: float(age) for _, replica, age in beats if age},
    )


def read_status_page(lighthouse: str, timeout: float = STATUS_TIMEOUT_S) -> str:
    url = lighthouse.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read(1 << 20).decode("utf-8", errors="replace")
    except (OSError, ValueError, http.client.HTTPException) as error:
        raise StatusPageUnreadable(f"cannot read {url}: {error}") from error


def read_lighthouse_status(lighthouse: str, timeout: float = STATUS_TIMEOUT_S) -> LighthouseStatus:
    """Fetch and parse the status page. Raises :class:`StatusPageUnreadable`, naming the URL."""
    page = read_status_page(lighthouse, timeout)
    try:
        return parse_status_page(page)
    except StatusPageUnreadable as error:
        raise StatusPageUnreadable(f"{lighthouse.rstrip('/')}/status: {error}") from None

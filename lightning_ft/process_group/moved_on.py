"""Whether the other members of this group's quorum have moved on: a marker in the quorum's own store.

A cross-group collective can only complete while every member of its quorum takes part. A member that has formed a
newer quorum has abandoned the old one: torchft reconfigures its process group at once, which ends its part of any
collective of the old quorum. So a member still waiting in such a collective waits for nothing
(:mod:`lightning_ft.process_group.left_behind` then gives the collective up instead of waiting out its timeout).

The signal is this project's own, and needs nothing from the lighthouse: every member of quorum *Q* at group rank
*r* reaches its process group through the same store prefix (``<primary's store>/torchft/<Q>/<r>``, torchft's
``Manager`` builds it). When a member reconfigures for a newer quorum, :meth:`MovedOnSignal.enter` first writes the
new quorum id under :data:`MARKER_KEY` in the old quorum's store. A member still in the old quorum reads it with one
non-blocking ``check`` of its own store client (:meth:`MovedOnSignal.moved_on`).

A member whose own part of a collective *failed* (a peer died in it and closed the connection) has abandoned the
quorum too: its step cannot commit, and the next quorum gets a new id. It writes :data:`ABANDONED` under the same key
at once (:meth:`MovedOnSignal.abandon`), because it may not be able to move on for a while: with DiLoCo, the
survivor whose allreduce failed is alone in asking for a new quorum while another survivor stays in the collective,
and one group is no majority of the groups that heartbeat. Without the marker, both would wait until the dead group
restarts (``docs/benchmarks.md`` has the figures).

When the old quorum's store is gone (its primary group died, and the store lived in that group's rank 0), no marker
can be written or read; but then a member of the quorum is dead, and its collective can never complete either: the
signal says so. Any other failure to read the store raises :class:`MovedOnUnknown`, and the caller falls back to the
collective's own timeout.

One quorum id is written per membership change, and a store client is kept per quorum: nothing is read or written
while steps succeed. A lighthouse that restarts numbers quorums from the start again; a reused quorum id on a
primary whose store still holds an old marker could then give up a collective pending longer than the watch's
``check_after``: that costs one uncommitted step and a heal, never a wrong weight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import Store
from torchft.process_group import create_store_client

from lightning_ft.errors import LightningFTError

log = logging.getLogger("lightning.pytorch.lightning_ft")

# Inside the process group's own prefix (``torchft/<quorum id>/<group rank>``): one marker per quorum and group rank.
MARKER_KEY = "lightning_ft/moved_on"
# The marker's value when a member's part of a collective failed (otherwise: the newer quorum's id).
ABANDONED = "abandoned"
STORE_TIMEOUT = timedelta(seconds=5)


class MovedOnUnknown(LightningFTError, RuntimeError):
    """The quorum's store could not be read, for another reason than being gone."""


@dataclass(frozen=True)
class MovedOn:
    """Another member left the quorum: for ``newer_quorum_id``; or (``None``) abandoned it after a failed collective,
    or the quorum's store is gone with its primary member."""

    newer_quorum_id: int | None
    by_this_group: bool = False  # this group reconfigures for a newer quorum itself
    abandoned: bool = False  # a member's part of a collective failed: that member's step cannot commit

    def describe(self) -> str:
        if self.abandoned:
            return "a member of the quorum abandoned it (its part of a collective failed: a peer died in it)"
        if self.newer_quorum_id is None:
            return "the quorum's store is gone with the group that hosted it"
        who = "this replica group" if self.by_this_group else "another replica group"
        return f"{who} moved on to quorum {self.newer_quorum_id}"


class MovedOnSignal:
    """One process's view of its current quorum's marker; :meth:`enter` at each reconfiguration of its process group.

    Args:
        store_gone: Whether the store at an address refuses connections
            (:func:`lightning_ft.process_group.quorum_store.store_refuses_connections`).
        connect: Opens a store client for a ``host:port/prefix`` address (replaceable in tests).
    """

    def __init__(
        self,
        store_gone: Callable[[str], bool],
        connect: Callable[[str, timedelta], Store] = create_store_client,
    ) -> None:
        self._connect = connect
        self._store_gone = store_gone
        self._lock = threading.Lock()
        self._store: Store | None = None
        self._store_addr: str | None = None
        self._quorum_id: int | None = None

    def enter(self, store_addr: str, quorum_id: int | None) -> None:
        """This process now joins the quorum whose process group lives at ``store_addr``: mark the previous quorum as
        left (best effort: its store may be gone), then keep a client of the new one to read its marker."""
        with self._lock:
            previous, self._store, self._store_addr, self._quorum_id = self._store, None, None, None
        if previous is not None and quorum_id is not None:
            try:
                previous.set(MARKER_KEY, str(quorum_id))
            except Exception as error:  # its primary is gone: its members fail at once anyway
                log.debug("lightning-ft: could not mark the previous quorum as left: %r", error)
        try:
            store = self._connect(store_addr, STORE_TIMEOUT)
        except Exception as error:  # torchft's own connection, made next, reports what is wrong
            log.debug("lightning-ft: no marker client for %s: %r", store_addr, error)
            return
        with self._lock:
            self._store, self._store_addr, self._quorum_id = store, store_addr, quorum_id

    def abandon(self, quorum_id: int | None) -> None:
        """This process's part of a collective of quorum ``quorum_id`` failed: mark that quorum as abandoned, unless it
        is no longer the current one (then this process already moved on, and marked it so). Best effort: a store
        that cannot be written is one whose primary is gone, which the other members see anyway."""
        with self._lock:
            store, current = self._store, self._quorum_id
        if store is None or quorum_id is None or quorum_id != current:
            return
        try:
            if not store.check([MARKER_KEY]):
                store.set(MARKER_KEY, ABANDONED)
        except Exception as error:
            log.debug("lightning-ft: could not mark quorum %s as abandoned: %r", quorum_id, error)

    @property
    def store(self) -> Store | None:
        """The client of the current quorum's store (prefixed with the process group's own prefix), if any."""
        with self._lock:
            return self._store

    def moved_on(self) -> MovedOn | None:
        """Whether another member has left the current quorum (or its store is gone); ``None`` while none has.

        Raises :class:`MovedOnUnknown` when there is no current quorum's store to read, or reading it fails while it
        still accepts connections."""
        with self._lock:
            store, store_addr = self._store, self._store_addr
        if store is None or store_addr is None:
            raise MovedOnUnknown("no store client for the current quorum")
        try:
            if not store.check([MARKER_KEY]):
                return None
            value = store.get(MARKER_KEY).decode()
            return MovedOn(None, abandoned=True) if value == ABANDONED else MovedOn(int(value))
        except Exception as error:
            if self._store_gone(store_addr):
                return MovedOn(None)
            raise MovedOnUnknown(f"cannot read the quorum's store at {store_addr}: {error}") from error

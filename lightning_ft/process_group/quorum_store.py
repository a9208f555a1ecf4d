"""lightning-ft's cross-group process groups: no wait of theirs outlasts a dead member for longer than a bound.

Three waits are bounded here: a reconfiguration through a dead primary's store (below), a rendezvous with a dead
member (:mod:`lightning_ft.process_group.arrival`), and a collective the other members have left
(:mod:`lightning_ft.process_group.left_behind`).

The first failure this answers (seen in the two-kill chaos test, here and in CI): a group sends its quorum request and
dies before the quorum forms. Its heartbeats are still fresh (the lighthouse's heartbeat timeout has not passed), so
the lighthouse puts it in the quorum. When the membership changed, every member reconfigures torchft's cross-group
process group through the TCPStore of the quorum's primary member. If the dead group is that primary, its store is
gone: the connection is refused, and torch's TCPStore client retries refused connections until the process group's
timeout (``FTStrategy(timeout=...)``, 60 s by default). The survivor sits out the whole timeout in its quorum while
the others, formed into the next quorum without it, train on; a short job can even finish meanwhile, and the
survivor then comes back to train alone.

A primary's store lives as long as its group's rank 0 (torchft 0.2: it is created before the group's Manager) or as
the first member's process group (torchft 0.3, which hosts the rendezvous store there), so a refused connection means
that process is gone. :class:`BoundedWaitsMixin` checks that with one plain TCP connect before torchft's
``configure`` or ``reconfigure`` and raises :class:`QuorumStoreGoneError` at once; torchft's quorum reports it, the
step does not commit, and the next quorum, without the dead group, rebuilds the process group. Any other outcome of
the probe (accepted, timed out, unreachable) leaves the connection to torchft as before.

A dead member that is *not* the primary leaves the store alive, and Gloo's rendezvous would wait for the dead
member's address until the timeout, inside native code where no thread can give it up. Every member therefore first
waits for the others in Python (:mod:`lightning_ft.process_group.arrival`), where a missing member gives the quorum up
within a second. The same classes wrap every operation of the Gloo process group in a watch that gives up a
collective the other members have left (:mod:`lightning_ft.process_group.left_behind`), and set aside, instead of
aborting, a process group that holds one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch.distributed as dist
from torchft import ProcessGroupGloo, ProcessGroupNCCL

from lightning_ft.errors import LightningFTError
from lightning_ft.process_group import torchft_api
from lightning_ft.process_group.arrival import wait_for_every_member
from lightning_ft.process_group.left_behind import LeftBehindWatch
from lightning_ft.process_group.moved_on import MovedOn, MovedOnSignal
from lightning_ft_job import events

PROBE_TIMEOUT_S = 5.0


class QuorumStoreGoneError(LightningFTError, ConnectionRefusedError):
    """The store of the quorum's primary member refuses connections: that member's group is gone."""


def store_host_port(store_addr: str) -> tuple[str, int]:
    """``(host, port)`` of torchft's ``host:port/prefix`` store address (IPv6 hosts may be bracketed)."""
    address = store_addr.partition("/")[0]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def store_refuses_connections(store_addr: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the store at ``store_addr`` refuses a TCP connection (its process is gone). Slow or unreachable is
    not refused: the caller's own connection and its timeout decide then."""
    host, port = store_host_port(store_addr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def fail_if_store_gone(store_addr: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`QuorumStoreGoneError` if the store at ``store_addr`` refuses a TCP connection."""
    if store_refuses_connections(store_addr, timeout):
        host, port = store_host_port(store_addr)
        raise QuorumStoreGoneError(
            f"lightning-ft: the new quorum's store at {host}:{port} refuses connections: the replica group hosting it "
            f"died after asking for this quorum. This step will not commit; the next quorum goes on without that group."
        )


class BoundedWaitsMixin:
    """Mixin for torchft's reconfigurable process groups: :func:`fail_if_store_gone` before each reconfiguration, the
    quorum's moved-on marker (:mod:`.moved_on`: the previous quorum is marked as left, and
    :attr:`moved_on_signal` reads the new one's), and every member's arrival before the rendezvous
    (:mod:`.arrival`). Both of torchft's entry points lead here: ``configure`` (torchft 0.2) and
    ``reconfigure`` (0.3; :mod:`.torchft_api`).

    With ``watches_collectives`` (Gloo), every operation is handed out through :attr:`left_behind_watch`, and a
    process group holding an operation that was given up is set aside instead of aborted."""

    watches_collectives = False
    entered_quorum_id: int | None = None  # the quorum this process group was last reconfigured for
    _rendezvous_host: str | None = None
    _make_rendezvous_store: Callable[[], Any] | None = None

    @cached_property  # torchft's process groups take their own constructor arguments: made on first use
    def moved_on_signal(self) -> MovedOnSignal:
        return MovedOnSignal(store_refuses_connections)

    @cached_property
    def left_behind_watch(self) -> LeftBehindWatch:
        signal = self.moved_on_signal
        return LeftBehindWatch(signal.moved_on, signal.abandon, quorum_id=lambda: self.entered_quorum_id)

    def advertise_rendezvous_store(self, host: str, make_store: Callable[[], Any]) -> None:
        """torchft 0.3 only: each process group hosts the rendezvous store of the quorums it comes first in, and
        torchft opens it on every interface and advertises ``socket.gethostname()``. Open it with ``make_store``
        instead (where the group's other listeners bind) and advertise ``host``, the group's advertised address."""
        self._rendezvous_host, self._make_rendezvous_store = host, make_store

    def get_reconfigure_handle(self) -> str:  # torchft 0.3
        if self._rendezvous_host is None or self._make_rendezvous_store is None:  # torchft's own choice
            handle: str = super().get_reconfigure_handle()  # type: ignore[misc]
            return handle
        torchft_api.host_rendezvous_store(self, self._make_rendezvous_store)
        return torchft_api.readdressed_handle(super().get_reconfigure_handle(), self._rendezvous_host)  # type: ignore[misc]

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:  # torchft 0.2
        quorum_id = kwargs.get("quorum_id", args[3] if len(args) > 3 else None)
        rank = kwargs.get("rank", args[1] if len(args) > 1 else None)
        world_size = kwargs.get("world_size", args[2] if len(args) > 2 else None)
        self._enter_quorum(store_addr, rank, world_size, quorum_id)
        super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]

    def reconfigure(self, options: Any) -> Any:  # torchft 0.3
        rendezvous = torchft_api.rendezvous_of(self, options)
        self._enter_quorum(rendezvous.store_addr, rendezvous.rank, rendezvous.world_size, rendezvous.quorum_id)
        return super().reconfigure(options)  # type: ignore[misc]

    def _enter_quorum(self, store_addr: str, rank: int | None, world_size: int | None, quorum_id: int | None) -> None:
        """The bounded waits before torchft's own rendezvous through ``store_addr``: the dead-store probe, the
        left-behind give-up of this group's pending operations, the moved-on marker and every member's arrival."""
        fail_if_store_gone(store_addr)
        if self.watches_collectives:  # this group moves on itself: what is pending of the old quorum cannot complete
            self.left_behind_watch.give_up(MovedOn(quorum_id, by_this_group=True))
        self.moved_on_signal.enter(store_addr, quorum_id)
        store = self.moved_on_signal.store
        if store is not None and rank is not None and world_size is not None:
            wait_for_every_member(store, rank, world_size, quorum_id)
        self.entered_quorum_id = quorum_id

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        work = super()._wrap_work(work, opts)  # type: ignore[misc]
        return self.left_behind_watch.track(work) if self.watches_collectives else work

    def abort(self, errored: bool = True) -> None:
        """torchft's abort, unless an operation of the current group was given up: Gloo's abort would wait for that
        operation to end by its own timeout, so the group is set aside instead (:meth:`set_aside_if_left_behind`)."""
        if self.set_aside_if_left_behind():
            return
        super().abort(errored)  # type: ignore[misc]

    def set_aside_if_left_behind(self) -> bool:
        """If an operation of the current Gloo group was given up, detach the group without aborting it; the next
        quorum builds a new one. A daemon thread holds the old group until its pending operation ends by its own
        timeout, so that its destructor (which joins Gloo's threads) runs there, or never if the process exits
        first. Returns whether it set a group aside."""
        if not (self.watches_collectives and self.left_behind_watch.take_left_behind()):
            return False
        old = getattr(self, "_pg", None)
        if old is None:
            return False
        self._pg = None
        seconds = self._timeout.total_seconds()  # type: ignore[attr-defined]
        threading.Thread(target=_hold, args=(old, seconds), name="lightning_ft_set_aside_pg", daemon=True).start()
        events.emit("process_group_set_aside", step=self.left_behind_watch.current_step())
        return True


def _hold(process_group: Any, seconds: float) -> None:
    """Keep ``process_group`` alive for its pending operation's timeout plus a margin, then let it go."""
    time.sleep(seconds + 5.0)
    del process_group


class StoreCheckedProcessGroupGloo(BoundedWaitsMixin, ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` that fails a reconfiguration through a dead primary's store at once, and gives
    up a collective the other members have left behind."""

    watches_collectives = True


class StoreCheckedProcessGroupNCCL(BoundedWaitsMixin, ProcessGroupNCCL):
    """torchft's ``ProcessGroupNCCL`` that fails a reconfiguration through a dead primary's store at once (its hung
    collectives are aborted by the step's deadline: :mod:`lightning_ft.process_group.step_deadline`)."""

    def errored(self) -> Exception | None:
        """The abort's error, if any, without torchft's second device sync: its one caller, the vote
        (``Manager.should_commit``), synchronizes the current stream just before it asks, which is what torchft's
        ``errored()`` does again (so that an abort that unblocked the stream is seen)."""
        return self._errored

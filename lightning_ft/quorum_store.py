"""Reconfiguring for a quorum that holds a dead group: fail at once, or give up once the others have gone on.

The failure this answers (seen in the two-kill chaos test, here and in CI): a group sends its quorum request and
dies before the quorum forms. Its heartbeats are still fresh (the lighthouse's heartbeat timeout has not passed), so
the lighthouse puts it in the quorum. When the membership changed, every member reconfigures torchft's cross-group
process group through the TCPStore of the quorum's primary member. If the dead group is that primary, its store is
gone: the connection is refused, and torch's TCPStore client retries refused connections until the process group's
timeout (``FTStrategy(timeout=...)``, 60 s by default). The survivor sits out the whole timeout in its quorum while
the others, formed into the next quorum without it, train on; a short job can even finish meanwhile, and the
survivor then comes back to train alone.

A primary's store lives as long as its group's rank 0 (it is created before the group's Manager), so a refused
connection means that group is gone. :class:`FailFastOnGoneStore` checks that with one plain TCP connect before
torchft's ``configure`` and raises :class:`QuorumStoreGoneError` at once; torchft's quorum reports it, the step does
not commit, and the next quorum, without the dead group, rebuilds the process group. Any other outcome of the probe
(accepted, timed out, unreachable) leaves the connection to torchft as before.

A dead member that is *not* the primary leaves the store alive, and Gloo's rendezvous waits for the dead member's
address until the timeout. :class:`StoreCheckedProcessGroupGloo` therefore runs the rendezvous on a helper thread
and, once it has taken over a second, reads the lighthouse's status page twice a second, as
:mod:`lightning_ft.left_behind` does for a pending allreduce: a quorum id newer than the one being configured means
the other groups went on without this one, and the reconfiguration fails with :class:`RendezvousLeftBehindError`
(the helper thread is left to run out its timeout, and whatever it builds is dropped). With only two groups no newer
quorum can form without this one, and the timeout still bounds the wait.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torchft import ProcessGroupGloo, ProcessGroupNCCL
from torchft.process_group import create_store_client

from lightning_ft.left_behind import CHECK_AFTER_S, INTERVAL_S, StatusPageUnreadable, lighthouse_quorum_id

PROBE_TIMEOUT_S = 5.0


class QuorumStoreGoneError(ConnectionRefusedError):
    """The store of the quorum's primary member refuses connections: that member's group is gone."""


def store_host_port(store_addr: str) -> tuple[str, int]:
    """``(host, port)`` of torchft's ``host:port/prefix`` store address (IPv6 hosts may be bracketed)."""
    address = store_addr.partition("/")[0]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def fail_if_store_gone(store_addr: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`QuorumStoreGoneError` if the store at ``store_addr`` refuses a TCP connection."""
    host, port = store_host_port(store_addr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except ConnectionRefusedError as error:
        raise QuorumStoreGoneError(
            f"lightning-ft: the new quorum's store at {host}:{port} refuses connections: the replica group hosting it "
            f"died after asking for this quorum. This step will not commit; the next quorum goes on without that group."
        ) from error
    except OSError:
        return  # slow or unreachable: torchft's own connection and its timeout decide


class RendezvousLeftBehindError(RuntimeError):
    """The other replica groups formed a newer quorum while this group was still setting up the process group of
    an older one (a member of it died after asking for it)."""


class FailFastOnGoneStore:
    """Mixin for torchft's reconfigurable process groups: :func:`fail_if_store_gone` before each ``configure``."""

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        fail_if_store_gone(store_addr)
        super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]


class StoreCheckedProcessGroupGloo(ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose reconfiguration fails at once through a dead primary's store, and gives
    up a rendezvous that the other groups have left behind.

    Args:
        timeout: The collective timeout, which torchft also gives the store connection and the rendezvous.
        lighthouse: The lighthouse URL; ``None`` (a single group with its embedded lighthouse) skips the watch.
        read_quorum_id: Reads the lighthouse's current quorum id (replaceable in tests).
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        lighthouse: str | None = None,
        read_quorum_id: Callable[[str], int] = lighthouse_quorum_id,
    ) -> None:
        super().__init__(timeout=timeout)
        self._lighthouse = lighthouse
        self._read_quorum_id = read_quorum_id

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """torchft 0.2.0's ``ProcessGroupWrapper.configure``, with the store probed first and the rendezvous (the
        store connection and Gloo's full-mesh connect) on a helper thread that this thread can stop waiting for."""
        fail_if_store_gone(store_addr)
        self._replica_id = replica_id
        self._quorum_id = quorum_id
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._rank = rank
        self._global_ranks = global_ranks
        self.abort(errored=False)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def rendezvous() -> None:
            try:
                store = create_store_client(store_addr, timeout=self._timeout)
                outcome["pg"] = self._create_pg(store, rank, world_size)
            except BaseException as error:  # handed to the configuring thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=rendezvous, name="lightning_ft_rendezvous", daemon=True).start()
        self._wait_for(done, quorum_id)
        if "error" in outcome:
            raise outcome["error"]
        self._pg = outcome["pg"]

    def _wait_for(self, done: threading.Event, quorum_id: int | None) -> None:
        """Until ``done``; raises :class:`RendezvousLeftBehindError` once the lighthouse is past ``quorum_id``."""
        started = time.monotonic()
        while not done.wait(INTERVAL_S):
            if self._lighthouse is None or quorum_id is None or time.monotonic() - started < CHECK_AFTER_S:
                continue
            try:
                current = self._read_quorum_id(self._lighthouse)
            except StatusPageUnreadable:
                continue  # the timeout still bounds the rendezvous
            if current > quorum_id:
                raise RendezvousLeftBehindError(
                    f"lightning-ft: the other replica groups formed quorum {current} while this group was still "
                    f"connecting the process group of quorum {quorum_id} after {time.monotonic() - started:.1f}s (a "
                    f"member of it died after asking for it); giving up. This step will not commit; the group heals "
                    f"from a live peer at the next quorum."
                )


class StoreCheckedProcessGroupNCCL(FailFastOnGoneStore, ProcessGroupNCCL):
    """torchft's ``ProcessGroupNCCL`` that fails a reconfiguration through a dead primary's store at once."""

"""Failing at once when a new quorum's store belongs to a group that is already gone.

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

Not covered: a dead member that is *not* the primary. The store is then alive, and Gloo's rendezvous waits for the
dead member's address until the timeout. The rendezvous cannot be given up from a helper thread (as
:mod:`lightning_ft.step.left_behind` gives up an allreduce): a thread still inside the rendezvous when the process
exits returns into Python during interpreter shutdown and aborts the process (SIGABRT), and torchrun would then restart
a group that had finished.
"""

from __future__ import annotations

import socket
from functools import cached_property
from typing import Any

from torchft import ProcessGroupGloo, ProcessGroupNCCL

from lightning_ft.manager.moved_on import MovedOnSignal

PROBE_TIMEOUT_S = 5.0


class QuorumStoreGoneError(ConnectionRefusedError):
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


if not callable(getattr(ProcessGroupGloo, "configure", None)):  # torchft after 0.2.0: ``reconfigure(...)``
    raise ImportError(
        "lightning-ft needs torchft 0.2.x, whose process groups reconfigure through `configure`; the installed torchft "
        "has no `ProcessGroupGloo.configure`, so the dead-store probe would be skipped. Install torchft>=0.2,<0.3."
    )


class FailFastOnGoneStore:
    """Mixin for torchft's reconfigurable process groups: :func:`fail_if_store_gone` before each ``configure``, and
    the quorum's moved-on marker (:mod:`lightning_ft.manager.moved_on`): the previous quorum is marked as left, and
    :attr:`moved_on_signal` reads the new one's."""

    @cached_property  # torchft's process groups take their own constructor arguments: made on first use
    def moved_on_signal(self) -> MovedOnSignal:
        return MovedOnSignal(store_refuses_connections)

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        fail_if_store_gone(store_addr)
        quorum_id = kwargs.get("quorum_id", args[3] if len(args) > 3 else None)
        self.moved_on_signal.enter(store_addr, quorum_id)
        super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]


class StoreCheckedProcessGroupGloo(FailFastOnGoneStore, ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` that fails a reconfiguration through a dead primary's store at once."""


class StoreCheckedProcessGroupNCCL(FailFastOnGoneStore, ProcessGroupNCCL):
    """torchft's ``ProcessGroupNCCL`` that fails a reconfiguration through a dead primary's store at once."""

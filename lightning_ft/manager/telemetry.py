"""What fault tolerance costs this process, measured where it happens: quorum waits, heals, quorum changes.

Every figure is this process's own truth (its replica group's, as every rank of a group sees the same quorums and
heals), counted since the process started its current fit: a restarted group starts again from zero. Nothing here
is ever averaged or exchanged across groups, so reading it costs no collective. The ``ft/`` metrics
(:class:`~lightning_ft.callbacks.FaultToleranceMonitor`), the progress bar and the event log read it.

Two measurements need a hook inside torchft's Manager:

* **Quorum wait**: ``Manager.wait_quorum`` is where the training thread blocks on a quorum, whoever asks (the start
  of a step with synchronous quorum, the first cross-group allreduce or ``num_participants()`` with asynchronous
  quorum, a validation's sync section). :class:`FTTelemetry` is a quorum observer of
  :class:`~lightning_ft.manager.ft_manager.FTManager`, which measures it there, however the call was reached.
* **Heal**: receiving the peer's state runs on torchft's quorum thread inside ``CheckpointTransport.recv_checkpoint``;
  applying it runs on the training thread in our load function. :class:`TimedTransport` wraps the transport that
  :func:`~lightning_ft.manager.build_manager` creates and times the receive; the load function times the apply
  (:class:`~lightning_ft.callbacks.StateTransferCallback`). A heal's duration is the sum.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from torchft.checkpointing import CheckpointTransport

from lightning_ft.manager.ft_manager import FTManager, QuorumSeen
from lightning_ft_job import events

T = TypeVar("T")


class TimedTransport(CheckpointTransport[T]):
    """A checkpoint transport that remembers how long its latest ``recv_checkpoint`` took; otherwise the inner one.

    ``recv_checkpoint`` runs on torchft's quorum thread. The training thread reads the duration only after that
    quorum has completed (torchft applies the received state after waiting on the quorum's future), so the value is
    complete when read; the lock only makes taking it atomic.
    """

    def __init__(self, inner: CheckpointTransport[T]) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._last_receive_seconds: float | None = None
        self._last_source: int | None = None

    def metadata(self) -> str:
        return self.inner.metadata()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        self.inner.send_checkpoint(dst_ranks=dst_ranks, step=step, state_dict=state_dict, timeout=timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        started = time.monotonic()
        try:
            return self.inner.recv_checkpoint(src_rank=src_rank, metadata=metadata, step=step, timeout=timeout)
        finally:
            with self._lock:
                self._last_receive_seconds = time.monotonic() - started
                self._last_source = src_rank

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)

    def take_receive(self) -> tuple[float | None, int | None]:
        """The latest receive's duration and source (the sender's replica rank in that quorum), once; ``(None,
        None)`` if nothing was received since the last call."""
        with self._lock:
            taken = (self._last_receive_seconds, self._last_source)
            self._last_receive_seconds = self._last_source = None
        return taken

    def __getattr__(self, name: str) -> Any:  # anything a transport offers beyond the ABC
        return getattr(self.inner, name)


@dataclass(frozen=True)
class Heal:
    """One heal of this group: the committed step it healed to and what it took."""

    step: int
    receive_seconds: float | None  # None: the transport was not a TimedTransport (a user-built Manager)
    apply_seconds: float
    # The sender's replica rank in the heal's quorum (torchft spreads simultaneous heals over the up-to-date
    # replicas, round robin); None as receive_seconds.
    source_replica_rank: int | None = None

    @property
    def seconds(self) -> float:
        return (self.receive_seconds or 0.0) + self.apply_seconds


class FTTelemetry:
    """This process's fault-tolerance figures for one fit (see the module docstring).

    Args:
        manager: The group's Manager, which tells this object of every quorum wait and quorum (a new one every fit).
        transport: The Manager's checkpoint transport when it is a :class:`TimedTransport`, to time heals.
        num_replica_groups: The job's size, for the progress bar's ``replicas P/N``.
    """

    def __init__(self, manager: FTManager, transport: TimedTransport[Any] | None, num_replica_groups: int) -> None:
        self.manager = manager
        self.transport = transport
        self.num_replica_groups = num_replica_groups
        self.quorum_wait_seconds_total = 0.0
        self._wait_at_step_start = 0.0
        self.quorum_id: int | None = None
        self.participants: int | None = None
        self.heals: list[Heal] = []
        self.uncommitted_steps = 0
        manager.add_quorum_observer(self)

    # ------------------------------------------------------------------ quorum (FTManager's observer)
    def quorum_waited(self, seconds: float) -> None:
        self.quorum_wait_seconds_total += seconds

    def quorum_formed(self, quorum: QuorumSeen) -> None:
        """Record the quorum just waited for; a new quorum id or participant count is an event."""
        if (quorum.quorum_id, quorum.participants) == (self.quorum_id, self.participants):
            return
        self.quorum_id, self.participants = quorum.quorum_id, quorum.participants
        events.emit(
            "quorum",
            step=self.manager.current_step(),
            quorum_id=quorum.quorum_id,
            participants=quorum.participants,
            replica_rank=quorum.replica_rank,
        )

    def step_started(self) -> None:
        """An optimizer step (or sync) opens its quorum: the per-step wait starts from zero."""
        self._wait_at_step_start = self.quorum_wait_seconds_total

    @property
    def step_quorum_wait_seconds(self) -> float:
        """How long the current (or latest) step has waited for its quorum so far."""
        return self.quorum_wait_seconds_total - self._wait_at_step_start

    def replicas(self) -> str | None:
        """``"P/N"``: replica groups in the latest quorum out of the job's; ``None`` before the first quorum."""
        if self.participants is None:
            return None
        return f"{self.participants}/{self.num_replica_groups}"

    # ------------------------------------------------------------------ votes and heals
    def step_voted(self, committed: bool) -> None:
        if not committed:
            self.uncommitted_steps += 1

    def healed(self, step: int, apply_seconds: float) -> Heal:
        """Record a heal whose state has just been applied; the receive was timed by the transport."""
        receive, source = self.transport.take_receive() if self.transport is not None else (None, None)
        heal = Heal(step=step, receive_seconds=receive, apply_seconds=apply_seconds, source_replica_rank=source)
        self.heals.append(heal)
        return heal

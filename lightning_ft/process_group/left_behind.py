"""Giving up a cross-group collective that the rest of the job has left behind.

The failure this answers (measured in ``docs/benchmarks.md``): when a replica group dies in the middle of a
cross-group collective, one survivor's Gloo operation may complete while another survivor's waits on a send that
never completes. Gloo fails that send only after the collective timeout (``FTStrategy(timeout=...)``, 60 s by
default). Meanwhile the first survivor goes on and the lighthouse forms the next quorum without the stuck one, which
keeps heartbeating. The stuck group loses up to a whole timeout of work; and when the others reach ``max_steps``
within it, the stuck group comes back to an empty job and trains its remaining steps alone.

torchft's remedy for a hung collective, aborting the process group, does not work with Gloo: ``abort()`` called from
another thread while an operation is pending blocks until that operation ends by itself (measured), and so would
the reconfiguration at the next quorum, which aborts the old process group first.

What this module does instead, for every operation of lightning-ft's Gloo cross-group process group
(:mod:`lightning_ft.process_group.quorum_store` wraps each one): the DDP and FSDP2 gradient hooks' allreduces, the
LocalSGD and DiLoCo syncs, the sync sections' and consistency checks' collectives, a heal's transfer alike.

* Each operation's ``Work`` is handed out wrapped (:meth:`LeftBehindWatch.track`): its future completes with the
  operation's own result or error, as usual.
* While one has been pending for longer than ``check_after`` seconds, a watchdog thread asks, once per ``interval``,
  whether another member of the quorum has left it: the marker that member wrote in the quorum's own store when it
  moved on to a newer quorum or finished (:mod:`lightning_ft.process_group.moved_on`; a store gone with its primary
  member counts too). If so, the watchdog gives the operation up: its future fails with
  :class:`CollectiveLeftBehindError`, which torchft's Manager (``Manager.allreduce``'s work, ``wrap_future``) and
  lightning-ft's DDP hook report as the step's error: the step does not commit, and the waiting thread goes on.
* When an operation *fails* here (a peer died in it and closed the connection), the watchdog marks the quorum as
  abandoned at once (:meth:`.moved_on.MovedOnSignal.abandon`): a member still waiting in the same
  collective, whose send is lost, then gives it up at its next read instead of waiting until some member moves on,
  which with DiLoCo can take until the dead group restarts.
* The process group holding a given-up operation is set aside, not aborted (:meth:`LeftBehindWatch.take_left_behind`
  is read by the process group's ``abort``); the next quorum builds a new one. A late completion of a given-up
  operation is ignored: its result belongs to a step that is already lost.

Why giving up is safe: a member that moved on has left the quorum's process group, so the collective can no longer
complete (nor can it once a member is dead), and no peer still needs this group's part of it; and a group that does
not commit a step heals from a live peer at the next quorum, so no committed step is lost. A wrong guess costs one
heal, never a wrong weight.

The signal needs no lighthouse: it works with the embedded one, an external one and any torchft release that keeps
the process group's store prefix per quorum. If the quorum's store cannot be read, the watchdog logs once and the
Gloo timeout bounds the stall as before. Steady-state training never reads it: a collective takes milliseconds, not
``check_after``. NCCL's hung collectives are aborted by the step's deadline instead
(:mod:`lightning_ft.process_group.step_deadline`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.errors import LightningFTError
from lightning_ft.process_group.moved_on import MovedOn, MovedOnUnknown
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

# An operation pending this long is either stuck or moving a lot of data; only then is the quorum's store read (one
# ``check`` of a key, some 100 microseconds, per interval: nothing against an operation that takes this long).
CHECK_AFTER_S = 0.5
# How often the marker is read while an operation stays pending.
INTERVAL_S = 0.25


class CrossGroupTimeoutError(LightningFTError, TimeoutError):
    """A cross-group operation did not complete within the ``wait(timeout)`` asked for (a ``TimeoutError``, as a
    backend's own ``wait(timeout)`` raises)."""


class CollectiveLeftBehindError(LightningFTError, RuntimeError):
    """Another member of the quorum left it while this group's cross-group collective was still pending."""


class WatchedWork(dist.Work):
    """A process group operation as torchft's Manager and the hooks see it: its future is the watch's, completed by
    the operation, or failed by the watch when the operation is given up."""

    def __init__(self, work: dist.Work, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._work = work  # the real operation, kept alive until it ends
        self._future = future

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the operation (or its give-up); raises its error, or :class:`CollectiveLeftBehindError`. With
        ``timeout``, raises ``TimeoutError`` once it has passed, as a backend's own ``wait(timeout)`` does.

        The event a timed wait needs is made here, not with the operation: the gradient hooks take the future and
        never wait, and every object and callback made per operation is paid once per gradient bucket."""
        if timeout is not None:
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())  # runs at once on a completed future
            if not done.wait(timeout.total_seconds()):
                raise CrossGroupTimeoutError(f"lightning-ft: a cross-group operation did not complete within {timeout}")
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def block_current_stream(self) -> None:
        self.wait()

    def synchronize(self) -> None:
        self.wait()


@dataclass(eq=False)  # compared and hashed by identity: the watch keeps the pending ones in a set
class _Pending:
    """One operation in flight: the future handed out for it, and the quorum it belongs to."""

    future: torch.futures.Future[Any]
    quorum_id: int | None
    started: float
    given_up: bool = False


class LeftBehindWatch:
    """Wraps each operation of a process group, and gives up the ones the rest of the job has left behind.

    Args:
        moved_on: Whether another member has left the current quorum
            (:meth:`lightning_ft.process_group.moved_on.MovedOnSignal.moved_on`).
        abandon: Marks a quorum as abandoned after one of its operations failed here
            (:meth:`.moved_on.MovedOnSignal.abandon`); called from the watchdog thread.
        quorum_id: The process group's current quorum id (for the error and the event).
        clock: Time source (replaceable in tests).
        check_after: Seconds an operation may be pending before the quorum's store is read.
        interval: Seconds between two reads while one stays pending.
    """

    def __init__(
        self,
        moved_on: Callable[[], MovedOn | None],
        abandon: Callable[[int | None], None] = lambda quorum_id: None,
        quorum_id: Callable[[], int | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        check_after: float = CHECK_AFTER_S,
        interval: float = INTERVAL_S,
    ) -> None:
        self._moved_on = moved_on
        self._abandon = abandon
        self._quorum_id = quorum_id
        self._clock = clock
        self._check_after = check_after
        self._interval = interval
        self._lock = threading.Lock()
        self._pending: set[_Pending] = set()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # set to make the watchdog act at once (a failed operation, shutdown)
        self._failed_quorums: set[int | None] = set()  # quorums with an operation failed here, not yet marked
        self._marked_quorums: set[int | None] = set()
        self._thread: threading.Thread | None = None
        self._warned_unreadable = False
        self._left_behind = False
        # The Manager's step, for the event (set once the Manager exists; the process group is built before it).
        self.current_step: Callable[[], int | None] = lambda: None

    def track(self, work: dist.Work) -> dist.Work:
        """``work`` as handed out: its future completes with the operation, or fails once the operation is given
        up. An operation without a future (Gloo's point-to-point sends and receives, which a heal over the process
        group uses, and which take their own timeout) is handed out as it is."""
        try:
            done = work.get_future()
        except RuntimeError:  # c10d's Work::getFuture "not implemented"
            return work
        pending = _Pending(torch.futures.Future(), self._quorum_id(), self._clock())
        with self._lock:
            self._pending.add(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="lightning_ft_left_behind", daemon=True)
                self._thread.start()

        def settle(finished: torch.futures.Future[Any]) -> None:
            with self._lock:
                if pending.given_up:
                    return
                self._pending.discard(pending)
            try:
                value = finished.value()
            except Exception as error:
                self._failed(pending.quorum_id)
                pending.future.set_exception(error)
            else:
                pending.future.set_result(value)

        done.add_done_callback(settle)
        return WatchedWork(work, pending.future)

    def _failed(self, quorum_id: int | None) -> None:
        """An operation of ``quorum_id`` failed here: have the watchdog mark the quorum as abandoned (a store write
        is not made in the backend's thread that completes the operation)."""
        with self._lock:
            if quorum_id in self._marked_quorums:
                return
            self._failed_quorums.add(quorum_id)
        self._wake.set()

    def mark_abandoned(self) -> None:
        """Mark each quorum with an operation failed here as abandoned, once (the watchdog's; callable in tests)."""
        with self._lock:
            quorums, self._failed_quorums = self._failed_quorums, set()
            self._marked_quorums |= quorums
        for quorum_id in quorums:
            self._abandon(quorum_id)

    def check(self) -> None:
        """One look at the pending operations (the watchdog's loop body; callable directly in tests)."""
        with self._lock:
            overdue = [p for p in self._pending if self._clock() - p.started >= self._check_after]
        if not overdue:
            return
        try:
            moved_on = self._moved_on()
        except MovedOnUnknown as error:
            if not self._warned_unreadable:
                self._warned_unreadable = True
                log.warning(
                    "lightning-ft: a cross-group collective has been pending for over %.0fs and this group cannot tell "
                    "whether the other groups went on without it (%s); waiting for the collective timeout "
                    "(FTStrategy(timeout=...)) instead.",
                    self._check_after,
                    error,
                )
            return
        if moved_on is not None:
            self.give_up(moved_on)

    def give_up(self, moved_on: MovedOn) -> bool:
        """Fail every pending operation with :class:`CollectiveLeftBehindError`; returns whether there was one."""
        with self._lock:
            left = list(self._pending)
            for pending in left:
                pending.given_up = True
            self._pending.clear()
            if left:
                self._left_behind = True
        if not left:
            return False
        waited = self._clock() - min(p.started for p in left)
        quorum_id = left[0].quorum_id
        error = CollectiveLeftBehindError(
            f"lightning-ft: {moved_on.describe()} while this group's cross-group collective of quorum {quorum_id} "
            f"was still pending after {waited:.1f}s; giving it up. This step will not commit; the group heals from a "
            f"live peer at the next quorum."
        )
        log.warning("%s", error)
        events.emit(
            "collective_left_behind",
            step=self.current_step(),
            quorum_id=quorum_id,
            newer_quorum_id=moved_on.newer_quorum_id,
            abandoned=moved_on.abandoned,
            waited_s=round(waited, 3),
        )
        for pending in left:
            pending.future.set_exception(error)
        return True

    def take_left_behind(self) -> bool:
        """Whether an operation was given up since the last call: its process group must then be set aside, not
        aborted (Gloo's abort would wait for the operation)."""
        with self._lock:
            left, self._left_behind = self._left_behind, False
        return left

    def _watch(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self.mark_abandoned()
                self.check()
            except Exception as error:  # the watchdog must never take the job down; Gloo's timeout still holds
                log.warning("lightning-ft: the left-behind watchdog failed: %r", error)

    def shutdown(self) -> None:
        self._stopped.set()
        self._wake.set()

"""Giving up a cross-group collective that the rest of the job has left behind.

The failure this answers (measured, ``docs/benchmarks.md`` section 2): when a replica group dies in the middle of a
step's gradient allreduce, one survivor's Gloo allreduce may complete while another survivor's waits on a send that
never completes. Gloo fails that send only after the collective timeout (``FTStrategy(timeout=...)``, 60 s by
default). Meanwhile the first survivor commits the step and the lighthouse forms the next quorum without the stuck
one, which keeps heartbeating. The stuck group loses up to a whole timeout of work; and when the others reach
``max_steps`` within it, the stuck group comes back to an empty job and trains its remaining steps alone.

torchft's remedy for a hung collective, aborting the process group, does not work with Gloo: ``abort()`` called from
another thread while an allreduce is pending blocks until that allreduce ends by itself (measured), and so would
the reconfiguration at the next quorum, which aborts the old process group first.

What this module does instead, for the DDP hook's allreduces over Gloo
(:func:`lightning_ft.step.gradient_hooks.cross_group_average`):

* Each allreduce hands DDP a future of its own (:meth:`LeftBehindWatch.track`), completed by the allreduce as usual.
* While one has been pending for longer than ``check_after`` seconds, a watchdog thread asks, once per ``interval``,
  whether another member of the allreduce's quorum has moved on to a newer quorum: the marker that member wrote in
  the quorum's own store when it reconfigured (:mod:`lightning_ft.manager.moved_on`; a store gone with its primary
  member counts too). If so, the watchdog gives the allreduce up: it reports :class:`CollectiveLeftBehindError` to
  the Manager (the step will not commit), then completes DDP's future with the bucket as it is, so the training
  thread reaches the commit vote.
* At the vote, :func:`set_aside_process_group` replaces torchft's process group with nothing instead of aborting
  it; the next quorum builds a new one. The old one is held by a daemon thread until its pending operation ends by
  its own timeout, so that its destructor, which joins Gloo's blocked thread, never runs on the training thread.
* The late completion of a given-up allreduce is ignored: its error belongs to a step that is already lost.

Why giving up is safe: a member that moved on has left the quorum's process group, so the collective can no longer
complete (nor can it once a member is dead), and no peer still needs this group's part of it; and a group that does
not commit a step heals from a live peer at the next quorum, so no committed step is lost. A wrong guess costs one
heal, never a wrong weight.

The signal needs no lighthouse: it works with the embedded one, an external one and any torchft release that keeps
the process group's store prefix per quorum. If the quorum's store cannot be read, the watchdog logs once and the
Gloo timeout bounds the stall as before. Steady-state training never reads it: a step's allreduce takes
milliseconds, not ``check_after``.

Not covered: FSDP2's hook and the semi-synchronous syncs wait on ``Manager.allreduce`` on the training thread, and
NCCL's hung collectives are aborted by torchft's own timer (``Manager.wrap_future``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchft import Manager

from lightning_ft.manager.moved_on import MovedOn, MovedOnUnknown
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

# An allreduce pending this long is either stuck or moving a lot of data; only then is the quorum's store read.
CHECK_AFTER_S = 1.0
# How often the marker is read while an allreduce stays pending.
INTERVAL_S = 0.5


class CollectiveLeftBehindError(RuntimeError):
    """Another member of the quorum moved on while this group's cross-group allreduce was still pending."""


@dataclass(eq=False)  # compared and hashed by identity: the watch keeps the pending ones in a set
class _Pending:
    """One allreduce in flight: DDP's future, the bucket it averages, and the quorum it belongs to."""

    result: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor
    quorum_id: int
    started: float
    given_up: bool = False


class LeftBehindWatch:
    """Hands DDP a future per cross-group allreduce, and gives up the ones the rest of the job has left behind.

    Args:
        manager: The group's torchft Manager (its current quorum id, and where errors are reported).
        moved_on: Whether another member has left the current quorum
            (:meth:`lightning_ft.manager.moved_on.MovedOnSignal.moved_on`).
        clock: Time source (replaceable in tests).
        check_after: Seconds an allreduce may be pending before the quorum's store is read.
        interval: Seconds between two reads while one stays pending.
    """

    def __init__(
        self,
        manager: Manager,
        moved_on: Callable[[], MovedOn | None],
        clock: Callable[[], float] = time.monotonic,
        check_after: float = CHECK_AFTER_S,
        interval: float = INTERVAL_S,
    ) -> None:
        self._manager = manager
        self._moved_on = moved_on
        self._clock = clock
        self._check_after = check_after
        self._interval = interval
        self._lock = threading.Lock()
        self._pending: set[_Pending] = set()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_unreadable = False
        self.process_group_left_behind = False

    def track(
        self,
        done: torch.futures.Future[Any],
        buffer: torch.Tensor,
        on_done: Callable[[torch.futures.Future[Any]], torch.Tensor],
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's future for the allreduce behind ``done``: ``on_done(done)`` once it completes, or ``buffer`` as it
        is if the watchdog gives the allreduce up first."""
        pending = _Pending(torch.futures.Future(), buffer, self._manager.quorum_id(), self._clock())
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
            pending.result.set_result(on_done(finished))

        done.add_done_callback(settle)
        return pending.result

    def check(self) -> None:
        """One look at the pending allreduces (the watchdog's loop body; callable directly in tests)."""
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
                    "lightning-ft: a cross-group allreduce has been pending for over %.0fs and this group cannot tell "
                    "whether the other groups went on without it (%s); waiting for the collective timeout "
                    "(FTStrategy(timeout=...)) instead.",
                    self._check_after,
                    error,
                )
            return
        if moved_on is not None:
            self._give_up(moved_on)

    def _give_up(self, moved_on: MovedOn) -> None:
        with self._lock:
            left = list(self._pending)
            for pending in left:
                pending.given_up = True
            self._pending.clear()
            if left:
                self.process_group_left_behind = True
        if not left:
            return
        waited = self._clock() - min(p.started for p in left)
        error = CollectiveLeftBehindError(
            f"lightning-ft: {moved_on.describe()} while this group's cross-group allreduce of quorum "
            f"{left[0].quorum_id} was still pending after {waited:.1f}s; giving it up. This step will not commit; the "
            f"group heals from a live peer at the next quorum."
        )
        if self._manager.errored() is None:
            log.warning("%s", error)
        # Before the futures complete: the training thread goes on to the commit vote as soon as they do.
        self._manager.report_error(error)
        events.emit(
            "collective_left_behind",
            step=self._manager.current_step(),
            quorum_id=left[0].quorum_id,
            newer_quorum_id=moved_on.newer_quorum_id,
            waited_s=round(waited, 3),
        )
        for pending in left:
            pending.result.set_result(pending.buffer)

    def take_left_behind(self) -> bool:
        """Whether an allreduce was given up since the last call: its process group must then be set aside, not
        aborted (:func:`set_aside_process_group`)."""
        with self._lock:
            left, self.process_group_left_behind = self.process_group_left_behind, False
        return left

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.check()
            except Exception as error:  # the watchdog must never take the job down; Gloo's timeout still holds
                log.warning("lightning-ft: the left-behind watchdog failed: %r", error)

    def shutdown(self) -> None:
        self._stopped.set()

"""A bounded exit on SIGTERM.

When torchrun's agent tears a replica group down (one of its processes died), it sends SIGTERM to the others and
waits 30 s before SIGKILL. Lightning's SIGTERM handler only sets a flag that is acted on at the next batch, and
Python runs signal handlers only between bytecodes of the main thread. A process that waits for its dead peer inside
a C++ collective (Lightning broadcasts on the group's process group every batch) runs neither. Meanwhile its Manager
keeps heartbeating, so the lighthouse counts the group as alive and the survivors' next quorum waits for it.

So SIGTERM keeps Lightning's graceful path and adds a deadline that does not depend on the main thread: CPython's
C-level signal handler writes the signal number to the wakeup fd at once, and a watcher thread reading it exits the
process if it is still alive after the grace period. Nothing committed is lost: live peers hold the state.

A process started by torchrun also asks for SIGTERM when its agent dies (:mod:`lightning_ft_job.parent_death`): an
agent that is SIGKILLed, or that ends without stopping its workers, would otherwise leave them training on as a group
that nobody supervises. They then end within the same grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning_ft_job import events
from lightning_ft_job.environment import ENV_TORCHRUN_RUN_ID
from lightning_ft_job.parent_death import signal_on_parent_death

SIGTERM_GRACE_SECONDS = 5.0

_Handler = Callable[[int, FrameType | None], Any] | int | None


# The watcher stops as soon as it reads the end of its pipe.
WATCHER_STOP_TIMEOUT_S = 5.0


class SigtermDeadline:
    """Installs the bounded-exit SIGTERM handling; ``uninstall`` restores what was there before."""

    def __init__(self, grace_seconds: float = SIGTERM_GRACE_SECONDS) -> None:
        self.grace_seconds = grace_seconds
        self._previous_handler: _Handler = None
        self._previous_wakeup_fd = -1
        self._write_fd: int | None = None
        # Both the main thread's handler (an immediate exit) and the watcher announce; the first one does it, whole.
        self._announce_lock = threading.RLock()
        self._announced = False
        self._watcher: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Uninstalled, whatever it was: a pickled strategy is a copy at rest, which installs its own when it fits."""
        return {"grace_seconds": self.grace_seconds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["grace_seconds"])  # type: ignore[misc]  # the one way to build its parts

    def install(self) -> None:
        if self._write_fd is not None or threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        # A Python-level handler must be set for the C handler to write to the wakeup fd.
        signal.signal(signal.SIGTERM, self._handle)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._write_fd = write_fd
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="lightning-ft-sigterm", daemon=True)
        self._watcher.start()
        if ENV_TORCHRUN_RUN_ID in os.environ and (ask := signal_on_parent_death(signal.SIGTERM)) is not None:
            # The parent now is this process's torchrun agent, unless the agent died during this process's start-up
            # (its parent is then init or a subreaper, which is not noticed here).
            ask(os.getppid())

    def uninstall(self) -> None:
        if self._write_fd is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        previous = self._previous_handler
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        os.close(self._write_fd)  # the watcher reads end-of-file and stops
        self._write_fd = None
        if self._watcher is not None:  # at once: a fit leaves no thread behind
            self._watcher.join(timeout=WATCHER_STOP_TIMEOUT_S)
            self._watcher = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handler
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            self._announce()  # the watcher may not have run yet: this exit must not lose the reason
            os._exit(128 + signum)

    def _announce(self, wait_seconds: float = -1) -> None:
        """Say why this process is about to end, in the event log (which outlives a launcher whose pipe carried
        this process's output) and on stderr. Once per process, whichever thread comes first; the other waits for it,
        at most ``wait_seconds`` when given (re-entrant, for a second SIGTERM arriving in the main thread while it
        announces)."""
        if not self._announce_lock.acquire(timeout=wait_seconds):
            return
        try:
            if self._announced:
                return
            self._announced = True
            self._write_announcement()
        finally:
            self._announce_lock.release()

    def _write_announcement(self) -> None:
        message = (
            f"lightning-ft: SIGTERM (parent process {os.getppid()}); this process exits within "
            f"{self.grace_seconds:.0f} s."
        )
        events.emit("sigterm", grace_seconds=self.grace_seconds, ppid=os.getppid())
        with contextlib.suppress(OSError, ValueError):
            print(message, file=sys.stderr, flush=True)

    def _watch(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                if self._previous_wakeup_fd >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self._previous_wakeup_fd, data)
                if signal.SIGTERM in data:
                    # The deadline runs from the signal, whatever the announcement costs or waits for.
                    deadline = time.monotonic() + self.grace_seconds
                    self._announce(wait_seconds=self.grace_seconds)
                    time.sleep(max(0.0, deadline - time.monotonic()))
                    os._exit(128 + signal.SIGTERM)
        finally:
            os.close(read_fd)

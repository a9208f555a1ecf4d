"""``SigtermDeadline`` (lightning_ft/signals.py): the bounded exit on SIGTERM, tested in this process.

Why it matters: torchrun's agent SIGTERMs the rest of a replica group when one process dies, and a process stuck in a
collective with its dead peer never runs Lightning's graceful handler, so its Manager keeps heartbeating and the
survivors' next quorum waits for it. The deadline must therefore come from a thread fed by the wakeup fd, not from
the main thread, while the graceful path (the handler that was there before) still runs. ``install`` and
``uninstall`` must leave the process's signal setup as they found it: the previous handler, and a previous wakeup fd
(asyncio's, for instance) that still gets its signal numbers.

``os._exit`` is replaced by a recorder, so nothing here ends the test process. Only one real SIGTERM is sent, with a
Python handler installed before, and every test that sends a signal waits for the watcher thread's exit call before it
ends (otherwise the real ``os._exit`` could run after the recorder is gone).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from lightning_ft import signals
from lightning_ft.signals import SigtermDeadline

pytestmark = pytest.mark.timeout(30)

WATCHER = "lightning-ft-sigterm"
GRACE = 0.3


class Exits:
    """Stands in for ``os._exit``: records the code, the calling thread and the time, and returns."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, float]] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.calls.append((code, threading.current_thread().name, time.monotonic()))
        self.called.set()

    def wait_for(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.calls) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.calls) >= count, f"expected {count} exit call(s) within {timeout} s, got {self.calls}"


class Recorder:
    """A previously installed Python SIGTERM handler (Lightning's, in a real run)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append((signum, threading.current_thread().name))


def watchers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == WATCHER]


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Exits:
    recorder = Exits()
    monkeypatch.setattr(os, "_exit", recorder)
    return recorder


@pytest.fixture
def deadline(exits: Exits) -> Iterator[Callable[..., SigtermDeadline]]:
    """Makes ``SigtermDeadline``s; at teardown uninstalls them, waits for their watchers to end and puts the process's
    SIGTERM handler and wakeup fd back. Depends on ``exits`` so that ``os._exit`` is restored only after that."""
    handler = signal.getsignal(signal.SIGTERM)
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    made: list[SigtermDeadline] = []

    def make(grace_seconds: float = GRACE) -> SigtermDeadline:
        made.append(SigtermDeadline(grace_seconds))
        return made[-1]

    yield make
    try:
        for each in made:
            each.uninstall()
        for thread in watchers():
            thread.join(timeout=5)
    finally:
        signal.signal(signal.SIGTERM, handler)
        signal.set_wakeup_fd(wakeup_fd)
    assert not watchers(), "a watcher thread outlived uninstall()"


@pytest.fixture
def previous_handler(deadline: Callable[..., SigtermDeadline]) -> Recorder:
    recorder = Recorder()
    signal.signal(signal.SIGTERM, recorder)  # restored by ``deadline``'s teardown, which saved the handler before
    return recorder


def test_sigterm_runs_the_previous_handler_and_the_watcher_exits_after_the_grace_period(
    deadline: Callable[..., SigtermDeadline], previous_handler: Recorder, exits: Exits
) -> None:
    """The graceful path first (the previous handler, on the main thread), then a hard exit with the conventional
    128 + SIGTERM status from the watcher thread once the grace period has passed, whatever the main thread does."""
    sigterm = deadline(GRACE)
    sigterm.install()
    sent = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    exits.wait_for(1)
    assert previous_handler.calls == [(signal.SIGTERM, threading.main_thread().name)]
    [(code, thread, when)] = exits.calls
    assert code == 128 + signal.SIGTERM
    assert thread == WATCHER, "the deadline must not depend on the main thread"
    assert when - sent >= GRACE * 0.9, f"exited {when - sent:.3f} s after SIGTERM, before the {GRACE} s grace period"


def test_the_deadline_holds_while_the_main_thread_is_stuck(
    deadline: Callable[..., SigtermDeadline], exits: Exits
) -> None:
    """A main thread that never gets back to the interpreter (here: stuck inside the graceful handler, as a process
    waiting in a C++ collective never reaches it) still exits: the exit comes while the main thread is blocked."""
    stuck: list[bool] = []

    def blocking_handler(signum: int, frame: FrameType | None) -> None:
        stuck.append(not exits.called.wait(timeout=5))  # blocks the main thread until the watcher exits

    signal.signal(signal.SIGTERM, blocking_handler)
    deadline(GRACE).install()
    os.kill(os.getpid(), signal.SIGTERM)
    exits.wait_for(1)
    assert stuck == [False], "the main thread waited in vain: nothing exited while it was blocked"
    assert exits.calls[0][:2] == (128 + signal.SIGTERM, WATCHER)


def test_an_announcement_that_cannot_be_made_does_not_hold_up_the_exit(
    deadline: Callable[..., SigtermDeadline], previous_handler: Recorder, exits: Exits
) -> None:
    """The announcement is one per process, under a lock that another thread may hold (the main thread, announcing
    itself, stuck in a write): the watcher waits for it at most until the deadline, then exits unannounced."""
    sigterm = deadline(GRACE)
    sigterm.install()
    held, release = threading.Event(), threading.Event()

    def hold_the_announcement() -> None:
        with sigterm._announce_lock:
            held.set()
            release.wait(timeout=10)

    holder = threading.Thread(target=hold_the_announcement)
    holder.start()
    try:
        assert held.wait(timeout=5)
        os.kill(os.getpid(), signal.SIGTERM)
        exits.wait_for(1)
        assert exits.calls[0][:2] == (128 + signal.SIGTERM, WATCHER)
        assert holder.is_alive(), "the exit came only once the announcement was free again"
    finally:
        release.set()
        holder.join(timeout=5)


@pytest.mark.parametrize("before", [signal.SIG_DFL, None], ids=["SIG_DFL", "no-python-handler"])
def test_with_no_previous_python_handler_the_handler_exits_at_once(
    deadline: Callable[..., SigtermDeadline], exits: Exits, monkeypatch: pytest.MonkeyPatch, before: Any
) -> None:
    """Without a graceful path to wait for, SIGTERM keeps its default meaning: exit now, 128 + SIGTERM. ``None`` is
    what ``signal.getsignal`` says for a handler not installed from Python. The installed handler is called directly
    (a real SIGTERM would also wake the watcher)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with monkeypatch.context() as patched:
        patched.setattr(signal, "getsignal", lambda signum: before)
        sigterm = deadline(GRACE)
        sigterm.install()
    installed = signal.getsignal(signal.SIGTERM)
    assert callable(installed)
    announced: list[str] = []
    monkeypatch.setattr(signals.events, "emit", lambda event, **fields: announced.append(event))
    installed(signal.SIGTERM, None)
    assert exits.calls and exits.calls[0][:2] == (128 + signal.SIGTERM, threading.main_thread().name)
    # The exit on the main thread may come before the watcher wakes: it must not take the reason with it.
    assert announced == ["sigterm"], announced
    sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_previously_ignored_sigterm_is_not_turned_into_an_immediate_exit(
    deadline: Callable[..., SigtermDeadline], exits: Exits
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deadline(GRACE).install()
    installed = signal.getsignal(signal.SIGTERM)
    assert callable(installed)
    installed(signal.SIGTERM, None)
    assert exits.calls == []


def test_uninstall_restores_the_previous_handler_and_wakeup_fd_and_stops_the_watcher(
    deadline: Callable[..., SigtermDeadline], previous_handler: Recorder
) -> None:
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        sigterm = deadline(GRACE)
        sigterm.install()
        assert signal.getsignal(signal.SIGTERM) is not previous_handler
        assert len(watchers()) == 1
        sigterm.uninstall()
        assert signal.getsignal(signal.SIGTERM) is previous_handler
        assert signal.set_wakeup_fd(-1) == write_fd
        for thread in watchers():
            thread.join(timeout=5)
        assert not watchers(), "the watcher thread did not stop: its pipe was not closed"
        sigterm.uninstall()  # a second uninstall does nothing
        assert signal.getsignal(signal.SIGTERM) is previous_handler
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_fd)
        os.close(write_fd)


def test_a_second_install_keeps_the_first_previous_handler(
    deadline: Callable[..., SigtermDeadline], previous_handler: Recorder
) -> None:
    """Installing twice must not record the deadline's own handler as "the previous one" (uninstall would then leave
    it in place, and SIGTERM would chain to itself forever), nor start a second watcher."""
    sigterm = deadline(GRACE)
    sigterm.install()
    sigterm.install()
    assert len(watchers()) == 1
    sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_install_and_uninstall_off_the_main_thread_do_nothing(
    deadline: Callable[..., SigtermDeadline], previous_handler: Recorder
) -> None:
    """Signal handlers can only be set on the main thread; a strategy set up from another thread must neither fail
    nor half-install."""
    errors: list[BaseException] = []

    def run(action: Callable[[], None]) -> None:
        def target() -> None:
            try:
                action()
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join(timeout=5)

    off_main = deadline(GRACE)
    run(off_main.install)
    assert errors == []
    assert signal.getsignal(signal.SIGTERM) is previous_handler
    assert not watchers()

    on_main = deadline(GRACE)
    on_main.install()
    installed = signal.getsignal(signal.SIGTERM)
    run(on_main.uninstall)
    assert errors == []
    assert signal.getsignal(signal.SIGTERM) is installed
    assert len(watchers()) == 1


def test_a_previous_wakeup_fd_still_gets_every_signal_and_other_signals_do_not_exit(
    deadline: Callable[..., SigtermDeadline], exits: Exits
) -> None:
    """The wakeup fd is one per process, so the deadline takes it over and forwards what it reads (asyncio's loop
    relies on it); only SIGTERM starts the deadline."""
    usr1: list[int] = []
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: usr1.append(signum))
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        sigterm = deadline(GRACE)
        sigterm.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        readable, _, _ = select.select([read_fd], [], [], 5)
        assert readable, "the previous wakeup fd did not get the signal number"
        assert os.read(read_fd, 64) == bytes([signal.SIGUSR1])
        assert usr1 == [signal.SIGUSR1]
        watcher = watchers()
        sigterm.uninstall()  # the watcher reads end-of-file and ends: after its deadline, had SIGUSR1 started one
        for thread in watcher:
            thread.join(timeout=10)
        assert watcher and not any(thread.is_alive() for thread in watcher), "the watcher did not end on uninstall"
        assert exits.calls == [], "a signal other than SIGTERM started the deadline"
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        signal.set_wakeup_fd(-1)
        os.close(read_fd)
        os.close(write_fd)

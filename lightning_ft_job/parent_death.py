"""A process that ends with its parent: Linux's ``PR_SET_PDEATHSIG``, from the child's side.

Two parents are watched this way. The launcher hosts the lighthouse and relays its groups' output; its torchrun
agents get SIGTERM when it dies (set by the launcher, between the fork and the agent's exec). A torchrun agent stops
its workers only while its own Python code runs: SIGKILLed (the OOM killer, ``kill -9``), or ending by a path that
skips its shutdown, it leaves them training on, heartbeating to the lighthouse as a group that nobody supervises,
restarts or hears. So each training process started by torchrun asks for SIGTERM when its agent dies, and then ends
within its SIGTERM grace (:mod:`lightning_ft.signals`).

The kernel sends the signal when the *thread* that forked the child ends. torchrun forks its workers from its main
thread and the launcher its agents from its own, so for both that is the process's end. Linux only: elsewhere
:func:`signal_on_parent_death` returns ``None`` and nothing is watched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int = signal.SIGTERM) -> Callable[[int], bool] | None:
    """A function ``ask(parent)`` that makes the calling process receive ``signum`` when ``parent``, its parent,
    dies, and returns whether ``parent`` was still its parent once asked. When it was not (the parent died first,
    so no signal will come), the caller has been sent ``signum`` already. ``None`` where Linux's ``prctl`` is missing.

    The libc function is looked up here, so that ``ask`` does only system calls: it may run in a ``preexec_fn``,
    between a fork and an exec, where the parent's other threads may have held locks at the fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def ask(parent: int) -> bool:
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() == parent:
            return True
        os.kill(os.getpid(), signum)
        return False

    return ask

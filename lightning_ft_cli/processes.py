"""Which processes a torchrun agent started: read from ``/proc``, so that the launcher signals only its own.

torchrun's elastic agent starts each worker in a session of its own, so signalling the agent's session does not reach
the workers. The launcher and the chaos monkey find them as the agent's children instead, by PID.

The other way round, :func:`terminate_with_parent` makes the agents end with the launcher when nothing of the
launcher runs to stop them (it was SIGKILLed).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def parent_pid(pid: int) -> int | None:
    """The parent of a live process; ``None`` once it has exited (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces; state and parent PID follow it.
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return None if state == "Z" else int(parent)


def children_of(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and parent_pid(int(entry.name)) == pid:
            children.append(int(entry.name))
    return children


def terminate_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when the process that starts it dies (Linux's
    ``PR_SET_PDEATHSIG``); ``None`` where that does not exist.

    The launcher hosts the lighthouse and relays its groups' output. If it is SIGKILLed (or killed by the OOM killer),
    no ``finally`` runs to stop its torchrun agents, which live in sessions of their own: without this they would train
    on against a lighthouse that is gone, with nobody reading their output. With it, each agent gets SIGTERM and stops
    its workers, which exit within their SIGTERM grace (see ``lightning_ft.signals``).

    The libc function is looked up here, before the fork: the child only calls it (a preexec_fn must do as little
    as possible, as other threads of the parent may hold locks at the fork).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal

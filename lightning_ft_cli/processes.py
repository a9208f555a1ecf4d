"""Which processes a torchrun agent started: read from ``/proc``, so that the launcher signals only its own.

torchrun's elastic agent starts each worker in a session of its own, so signalling the agent's session does not reach
the workers. The launcher and the chaos monkey find them as the agent's children instead, by PID.

The other way round, :func:`terminate_with_parent` makes the agents end with the launcher when nothing of the
launcher runs to stop them (it was SIGKILLed).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from lightning_ft_job.parent_death import signal_on_parent_death


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
    """A ``preexec_fn`` that makes the child receive SIGTERM when the process that starts it dies
    (:mod:`lightning_ft_job.parent_death`); ``None`` where that does not exist.

    The launcher hosts the lighthouse and relays its groups' output. If it is SIGKILLed (or killed by the OOM killer),
    no ``finally`` runs to stop its torchrun agents, which live in sessions of their own: without this they would train
    on against a lighthouse that is gone, with nobody reading their output. With it, each agent gets SIGTERM and stops
    its workers, which exit within their SIGTERM grace (see ``lightning_ft.signals``).
    """
    ask = signal_on_parent_death(signal.SIGTERM)
    if ask is None:
        return None
    parent = os.getpid()

    def end_with_the_launcher() -> None:
        ask(parent)  # when the launcher is gone already, this process has been sent SIGTERM

    return end_with_the_launcher

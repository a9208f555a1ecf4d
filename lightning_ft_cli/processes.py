"""Which processes a torchrun agent started: read from ``/proc``, so that the launcher signals only its own.

torchrun's elastic agent starts each worker in a session of its own, so signalling the agent's session does not reach
the workers. The launcher and the chaos monkey find them as the agent's children instead, by PID.

The other way round, :func:`terminate_with_parent` makes the agents end with the launcher when nothing of the
launcher runs to stop them (it was SIGKILLed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from lightning_ft_job.parent_death import signal_on_parent_death

# How long the launcher's SIGTERM to a group's torchrun job has before SIGKILL.
STOP_GRACE_SECONDS = 10.0


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


def stop_process_sessions(processes: list[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM each torchrun job we started (its agent stops its workers), then SIGKILL what is left of them.

    A worker stuck where SIGTERM cannot stop it (inside a collective with a dead peer, say) keeps its agent waiting
    for its own 30-s grace. After ours, the agent's session gets SIGKILL, and so does each worker's: torchrun starts
    every worker in a session of its own, which the agent's does not include, and a worker left behind would live on
    as an orphan.
    """
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            workers = children_of(process.pid)  # before the agent dies: then they would be init's children
            # The group runs in the session we created for it, whose id is the torchrun PID we started.
            os.killpg(process.pid, signal.SIGKILL)
            for worker in workers:
                _kill_session(worker)
            process.wait()


def _kill_session(leader: int) -> None:
    """SIGKILL the session that ``leader`` leads (a worker and its data-loader processes), or ``leader`` alone."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGKILL)

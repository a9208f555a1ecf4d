"""Which processes a torchrun agent started: read from ``/proc``, so that the launcher signals only its own.

torchrun's elastic agent starts each worker in a session of its own, so signalling the agent's session does not reach
the workers. The launcher and the chaos monkey find them as the agent's children instead, by PID.
"""

from __future__ import annotations

from pathlib import Path


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

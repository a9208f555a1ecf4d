"""What lightning-ft reads and changes inside a torchft 0.2.0 Manager, in one module, through functions.

The rest of the package calls these instead of touching a private name, so that a torchft upgrade is a diff here.
They take any Manager (or a test's stand-in with the same attributes):

* :func:`cross_group_process_group`: the Manager's reconfigurable process group (``Manager._pg``), which carries the
  DDP and FSDP2 comm hooks' allreduces, the failure injector's faults and the aborts below. Upstream hook that would
  remove it: a public accessor for the process group the Manager was built with.
* :func:`abort_cross_group_process_group` and :func:`set_aside_process_group`: end the current Gloo group after a
  failed step, at once or without waiting for a pending operation (``ProcessGroupWrapper._pg``, ``._timeout``).
  torchft's nightly reconfigures the group with ``reconfigure(...)`` instead of ``configure``; both functions only
  need "drop the current inner group", which a ``reset()`` upstream would give.
* :func:`process_group_timeout`: the wrapper's collective timeout (``ProcessGroupWrapper._timeout``).
* :func:`moved_on_signal`: the moved-on marker kept by lightning-ft's process group classes (through ``Manager._pg``).
* :func:`install_client`: replaces the Manager's RPC client (``Manager._client``) once, with the composed wrapper of
  :mod:`lightning_ft.manager.builder`. Upstream hook: client injection in the Manager's constructor.

The quorum id and the quorum observers are :class:`~lightning_ft.manager.ft_manager.FTManager` methods.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from torchft import Manager, ProcessGroupGloo
from torchft.process_group import ProcessGroup

from lightning_ft.manager.moved_on import MovedOnSignal


def cross_group_process_group(manager: Manager) -> ProcessGroup:
    """The process group between replica groups: rank *r* of every group with rank *r* of the others."""
    return manager._pg


def crosses_groups_over_gloo(manager: Manager) -> bool:
    """Whether the cross-group process group is Gloo (it carries its own timeout; NCCL needs the Manager's)."""
    return isinstance(manager._pg, ProcessGroupGloo)


def moved_on_signal(manager: Manager) -> MovedOnSignal | None:
    """The moved-on marker of the cross-group process group's current quorum (:mod:`lightning_ft.manager.moved_on`),
    or None for a process group that lightning-ft did not build."""
    signal = getattr(getattr(manager, "_pg", None), "moved_on_signal", None)
    return signal if isinstance(signal, MovedOnSignal) else None


def process_group_timeout(process_group: Any, default: timedelta = timedelta(seconds=60)) -> timedelta:
    """The timeout of torchft's reconfigurable process group: how long its collectives may take."""
    timeout = getattr(process_group, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else default


def abort_cross_group_process_group(manager: Manager) -> bool:
    """Abort the cross-group process group's current Gloo (or NCCL) group; the next quorum builds a new one.
    Returns whether there was one to abort. Raises what the abort raises."""
    abort = getattr(getattr(manager, "_pg", None), "abort", None)
    if abort is None:
        return False
    abort()
    return True


def set_aside_process_group(manager: Manager) -> bool:
    """Detach torchft's reconfigurable process group from its current Gloo group without aborting it.

    The next quorum then builds a new one (``ProcessGroupWrapper.configure`` aborts only a group it still holds).
    The old group still has an operation pending; a daemon thread holds it until that operation ends by its own
    timeout, so that its destructor (which joins Gloo's threads) runs there, or never if the process exits first.
    Returns whether there was a group to set aside.
    """
    wrapper = getattr(manager, "_pg", None)
    old = getattr(wrapper, "_pg", None)
    if old is None:
        return False
    wrapper._pg = None  # type: ignore[union-attr]
    seconds = process_group_timeout(wrapper).total_seconds()
    threading.Thread(target=_hold, args=(old, seconds), name="lightning_ft_set_aside_pg", daemon=True).start()
    return True


def _hold(process_group: Any, seconds: float) -> None:
    """Keep ``process_group`` alive for its pending operation's timeout plus a margin, then let it go."""
    time.sleep(seconds + 5.0)
    del process_group


def manager_client(manager: Manager) -> Any:
    """The Manager's RPC client to its group's ManagerServer (quorum requests, the commit vote)."""
    return manager._client


def install_client(manager: Manager, client: Any) -> None:
    """Make ``client`` (a wrapper of :func:`manager_client`) the Manager's RPC client."""
    manager._client = client

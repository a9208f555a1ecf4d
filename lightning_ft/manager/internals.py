"""What lightning-ft reads and changes inside a torchft 0.2.0 Manager, in one module, through functions.

The rest of the package calls these instead of touching a private name, so that a torchft upgrade is a diff here.
They take any Manager (or a test's stand-in with the same attributes):

* :func:`cross_group_process_group`: the Manager's reconfigurable process group (``Manager._pg``), which carries the
  DDP and FSDP2 comm hooks' allreduces, the failure injector's faults and the aborts below. Upstream hook that would
  remove it: a public accessor for the process group the Manager was built with.
* :func:`abort_cross_group_process_group` and :func:`set_aside_if_left_behind`: end the current Gloo group after a
  failed step, at once or (when one of its operations was given up) without waiting for it. The second is
  lightning-ft's own process group class (:mod:`lightning_ft.process_group.quorum_store`), which reaches into
  ``ProcessGroupWrapper._pg`` and ``._timeout``. torchft's nightly reconfigures the group with ``reconfigure(...)``
  instead of ``configure``; both only need "drop the current inner group", which a ``reset()`` upstream would give.
* :func:`process_group_timeout`: the wrapper's collective timeout (``ProcessGroupWrapper._timeout``).
* :func:`intercept_backend_works`: a function between the backend's operations and the wrapper's handling of them
  (``ProcessGroupWrapper._wrap_work``), for the failure injector's stuck collectives.
* :func:`left_behind_watch`: the watch over pending collectives kept by lightning-ft's process group classes
  (through ``Manager._pg``).
* :func:`install_client`: replaces the Manager's RPC client (``Manager._client``) once, with the composed wrapper of
  :mod:`lightning_ft.manager.builder`. Upstream hook: client injection in the Manager's constructor.
* :func:`new_manager_client`: a second RPC client to this rank's ManagerServer (its address from the group's store,
  ``Manager._store``, under torchft's ``MANAGER_ADDR_KEY``), with which
  :mod:`lightning_ft.manager.lighthouse_outage` releases a quorum request that a lighthouse outage left hanging.
  Upstream hook: a ManagerServer that answers its pending quorum requests with the lighthouse's error.
* :func:`diloco_fragments`, :func:`fragment_outer_optimizer` and :func:`fragment_updates_off`: torchft's DiLoCo
  fragments (``DiLoCo._fragments``), each one's outer optimizer (``_outer_optimizer``), and their
  ``_fragment_update_alpha`` set to 0 for a sync that must take the global parameters as they are (the final sync),
  for :mod:`lightning_ft.algorithms.diloco`. Upstream hooks: public ``fragments`` and ``outer_optimizer``, and an
  update alpha per sync call.
* :func:`quorum_in_place`: whether the Manager's latest quorum formed and nothing has failed on its process group
  since (``Manager._quorum_future``), for a sync section that can use it instead of asking the lighthouse again.
  Upstream hook: a public ``quorum_ready()``.
* :func:`quorum_threads`: the threads of the Manager's quorum executor (``Manager._executor._threads``), which
  ``Manager.shutdown(wait=False)`` leaves running; the handle joins them, bounded, so that a fit leaves no thread
  behind. Upstream hook: a ``shutdown`` that waits for the quorum thread with a timeout.
* :func:`lifetime_replica_id`: the replica id torchft registered for this process lifetime (``Manager._store``, under
  ``REPLICA_ID_KEY``), for :mod:`lightning_ft.manager.group_claim`. Upstream hook: a public ``replica_id()``.

The quorum id and the quorum observers are :class:`~lightning_ft.manager.ft_manager.FTManager` methods.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from torch.distributed import AllreduceOptions, ReduceOp
from torch.optim import Optimizer
from torchft import Manager, ProcessGroupGloo
from torchft._torchft import ManagerClient
from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY
from torchft.process_group import ProcessGroup

from lightning_ft.process_group.left_behind import LeftBehindWatch

# Every private torchft name lightning-ft reaches, here and in the other modules of the torchft seam (manager/ and
# process_group/), one row each: why; the upstream hook that would remove it. The one inventory, which
# ``tests/package/test_seams.py`` keeps exact.
PRIVATE_USES = {
    "_torchft": "torchft's Rust extension, for a second ManagerClient; a public ManagerClient",
    "_pg": "the Manager's cross-group process group; an accessor for it",
    "_client": "the Manager's RPC client, wrapped once; client injection in the constructor",
    "_quorum": "the wrapped ManagerClient's quorum RPC (Rust in torchft 0.2), which the client wrappers "
    "(group_claim, lighthouse_outage, quorum_members) intercept; a public client hook",
    "_handle_id": "torchft 0.3's reconfigure handle of a process group (process_group/torchft_api.py); same API",
    "_rendezvous_store": "torchft 0.3's rendezvous store a process group hosts (process_group/torchft_api.py); an "
    "option to host it where the group's listeners bind",
    "_store": "the group's store: the ManagerServer's address, this lifetime's replica id; a public replica_id()",
    "_executor": "the quorum thread, joined bounded after shutdown; a shutdown that waits with a timeout",
    "_timeout": "ProcessGroupWrapper's collective timeout; a public timeout",
    "_errored": "ProcessGroupNCCL's abort error, read without a second device sync after the vote's; an errored() "
    "that does not synchronize",
    "_wrap_work": "watch every operation of the process group; a cancellable work",
    "_fragments": "DiLoCo's fragments; public fragments",
    "_outer_optimizer": "a fragment's outer optimizer; a public outer_optimizer",
    "_fragment_update_alpha": "the final sync takes the global parameters as they are; an update alpha per sync",
    "_save_parameters": "take the current parameters as DiLoCo's global ones; a public reset",
    "_quorum_future": "report each quorum once; take a known quorum without the profiler range; a quorum callback",
    "_quorum_id": "the quorum id for events and telemetry; a quorum-id accessor",
    "_participating_replica_rank": "the quorum's membership; a quorum callback",
    "_participating_replica_world_size": "same",
    "_healing": "vet a received state before the first collective; a heal-check hook",
    "_pending_state_dict": "same",
    "_apply_pending_state_dict": "same (FTManager overrides it)",
    "_step": "heal a job at step 0 before the forward pass; counting only contributing groups",
    "_use_async_quorum": "same",
    "_create_pg": "bind Gloo to the advertised address (listeners.py overrides it); a bind address option",
    "_global_ranks": "the group's global ranks, as torchft's _create_pg passes them; same",
    "_group_rank": "same",
    "_group_world_size": "same",
    "_rendezvous": "torchft 0.3's rendezvous (torchft_api.py); a pre-rendezvous hook",
    "_server": "HTTPTransport's server, rebound to one host and stopped on shutdown; a bind address option",
    "_thread": "its serving thread; a shutdown that stops serving",
    "_serve": "its serving loop, on the rebound server; same",
    "_load_from_address": "the streamed, weights_only load of a heal (http_transport.py overrides it); a load hook",
}


def new_manager_client(manager: Manager, connect_timeout: timedelta) -> Callable[[], Any]:
    """A factory of fresh ``ManagerClient`` s to this rank's ManagerServer (the one :func:`manager_client` talks to).
    The address is read now; each call connects anew."""
    address = manager._store.get(MANAGER_ADDR_KEY).decode("utf-8")

    def connect() -> Any:
        return ManagerClient(address, connect_timeout=connect_timeout)

    return connect


def quorum_in_place(manager: Manager) -> bool:
    """Whether the Manager holds a quorum whose process group can carry one more collective: the latest quorum formed
    (``Manager._quorum_future`` done, without error) and nothing has failed since (``errored()``, which only the next
    quorum clears; a step rejected for a non-finite gradient counts as failed too, to stay on the safe side)."""
    future = getattr(manager, "_quorum_future", None)
    if future is None or not future.done() or future.exception() is not None:
        return False
    return manager.errored() is None


def quorum_threads(manager: Manager) -> list[threading.Thread]:
    """The Manager's quorum threads (at most one: torchft's executor has a single worker)."""
    executor = getattr(manager, "_executor", None)
    return list(getattr(executor, "_threads", ()))


def lifetime_replica_id(manager: Manager) -> str:
    """This process lifetime's replica id as the lighthouse knows it (the group's id, ``:``, a fresh uuid), which
    torchft's group rank 0 publishes in the group's store."""
    return manager._store.get(REPLICA_ID_KEY).decode("utf-8")


#: The options of every sum lightning-ft sends on the cross-group process group itself (the gradient hook, the
#: buffers' average, the quorum-kind and job-contract exchanges): ``process_group.allreduce([t], CROSS_GROUP_SUM)``.
CROSS_GROUP_SUM = AllreduceOptions()
CROSS_GROUP_SUM.reduceOp = ReduceOp(ReduceOp.SUM)


def cross_group_process_group(manager: Manager) -> ProcessGroup:
    """The process group between replica groups: rank *r* of every group with rank *r* of the others."""
    return manager._pg


def crosses_groups_over_gloo(manager: Manager) -> bool:
    """Whether the cross-group process group is Gloo (it carries its own timeout; NCCL needs the Manager's)."""
    return isinstance(manager._pg, ProcessGroupGloo)


def process_group_timeout(process_group: Any, default: timedelta = timedelta(seconds=60)) -> timedelta:
    """The timeout of torchft's reconfigurable process group: how long its collectives may take."""
    timeout = getattr(process_group, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else default


def intercept_backend_works(process_group: Any, intercept: Callable[[Any], Any]) -> None:
    """Pass each backend operation's ``Work`` through ``intercept`` before the reconfigurable process group handles
    it (lightning-ft's watch over pending operations included)."""
    wrap_work = process_group._wrap_work

    def intercepted(work: Any, opts: object) -> Any:
        return wrap_work(intercept(work), opts)

    process_group._wrap_work = intercepted


def abort_cross_group_process_group(manager: Manager) -> bool:
    """Abort the cross-group process group's current Gloo (or NCCL) group; the next quorum builds a new one.
    Returns whether there was one to abort. Raises what the abort raises."""
    abort = getattr(getattr(manager, "_pg", None), "abort", None)
    if abort is None:
        return False
    abort()
    return True


def left_behind_watch(manager: Manager) -> LeftBehindWatch | None:
    """The watch over the cross-group process group's pending operations
    (:mod:`lightning_ft.process_group.left_behind`), or None for a process group that does not watch them (NCCL, or
    one lightning-ft did not build)."""
    process_group = getattr(manager, "_pg", None)
    if not getattr(process_group, "watches_collectives", False):
        return None
    watch = getattr(process_group, "left_behind_watch", None)
    return watch if isinstance(watch, LeftBehindWatch) else None


def set_aside_if_left_behind(manager: Manager) -> bool:
    """Set the cross-group Gloo group aside, unaborted, if one of its operations was given up; returns whether it
    did (:meth:`lightning_ft.process_group.quorum_store.BoundedWaitsMixin.set_aside_if_left_behind`)."""
    set_aside = getattr(getattr(manager, "_pg", None), "set_aside_if_left_behind", None)
    return bool(set_aside()) if set_aside is not None else False


def manager_client(manager: Manager) -> Any:
    """The Manager's RPC client to its group's ManagerServer (quorum requests, the commit vote); ``None`` for a
    stand-in Manager without one."""
    return getattr(manager, "_client", None)


def install_client(manager: Manager, client: Any) -> None:
    """Make ``client`` (a wrapper of :func:`manager_client`) the Manager's RPC client."""
    manager._client = client


def diloco_fragments(diloco: Any) -> list[Any]:
    """The fragments of a ``torchft.local_sgd.DiLoCo``, in sync order (each holds its ``original_parameters``)."""
    fragments: list[Any] = diloco._fragments
    return fragments


def save_global_parameters(diloco: Any) -> None:
    """Take a ``torchft.local_sgd.DiLoCo``'s current parameters as its global ones (each fragment's copy)."""
    diloco._save_parameters()


def fragment_outer_optimizer(fragment: Any) -> Optimizer:
    """The outer optimizer of one DiLoCo fragment."""
    optimizer: Optimizer = fragment._outer_optimizer
    return optimizer


@contextlib.contextmanager
def fragment_updates_off(fragments: list[Any]) -> Iterator[None]:
    """Every fragment's update alpha at 0 (the sync takes the global parameters as they are), restored after."""
    alphas = [fragment._fragment_update_alpha for fragment in fragments]
    for fragment in fragments:
        fragment._fragment_update_alpha = 0.0
    try:
        yield
    finally:
        for fragment, alpha in zip(fragments, alphas, strict=True):
            fragment._fragment_update_alpha = alpha

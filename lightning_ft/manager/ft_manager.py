"""FTManager: torchft's Manager with the few things lightning-ft needs from it, as public methods.

Four behaviours are added where torchft has no hook for them:

* **A healing replica's received state is vetted before anything else happens with it.** With an asynchronous
  quorum, torchft loads the peer's state only at the commit vote, after the gradient allreduce; a model of another
  shape reaches that allreduce first, where Gloo aborts the *healthy* peer's process on the size mismatch. The
  registered checks run as soon as the quorum is known, so the healing group fails alone, with an error naming the
  parameter and both shapes.
* **A job at step 0 heals before its first forward pass**, also with an asynchronous quorum, so that every group
  counted in the first step's average contributes to it (:meth:`FTManager.start_quorum`).
* **A quorum already known is not waited for again through the profiler.** torchft's ``wait_quorum`` is
  ``_quorum_future.result()`` inside a ``record_function`` range, called several times per step; once the quorum is
  known, and with no profiler running, the range is skipped (its cost per call is in ``docs/benchmarks.md``), and so
  are the observers once they have heard of the quorum: its later waits take no time and tell them nothing new.
* **Quorum observers** learn how long the training thread waited for each quorum and which quorum it got, measured
  in ``wait_quorum`` itself: every caller that blocks on a quorum passes there (the start of a synchronous step, the
  first cross-group allreduce or ``num_participants()`` with an asynchronous quorum, a sync section). They hear of
  a new quorum before its heal is vetted, and may exchange with the quorum's groups then (the job's start compares
  every group's settings there, :mod:`lightning_ft.start.contract`); a received state they find to come from
  another job is dropped (:meth:`FTManager.discard_heal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from time import monotonic
from typing import Any, Protocol

from torchft import Manager
from typing_extensions import override

from lightning_ft.manager.http_transport import RefusedPeerStateError
from lightning_ft.settings import FTConfigError
from lightning_ft.torch_internals import profiler_enabled


@dataclass(frozen=True)
class QuorumSeen:
    """The quorum a replica group just got: torchft's quorum id, how many groups take part, and this group's rank
    among them (``None`` when it does not take part: it heals, or it is a spare)."""

    quorum_id: int
    participants: int
    replica_rank: int | None


class QuorumObserver(Protocol):
    """Told of every wait for a quorum (``seconds``) and of every new quorum, on the training thread.

    ``quorum_formed`` runs before anything received in that quorum is vetted or loaded. It may exchange with the
    quorum's other members over its process group, and raise to stop this group."""

    def quorum_waited(self, seconds: float) -> None: ...

    def quorum_formed(self, quorum: QuorumSeen) -> None: ...


class FTManager(Manager):
    """torchft's Manager, vetting a healing replica's received state first and telling observers of its quorums.

    Relies on attributes of torchft 0.2.0's Manager, all read here and in :mod:`lightning_ft.manager.internals`
    only: ``_step`` and ``_use_async_quorum`` (the first step's early heal); ``_healing`` and ``_pending_state_dict``
    (the quorum thread stores the received state there, and the Manager loads it later on the training thread in
    ``_apply_pending_state_dict``, overridden here to vet first); ``_quorum_future``, ``_quorum_id``,
    ``_participating_replica_world_size`` and ``_participating_replica_rank`` (what the quorum just completed set).
    """

    _healing: bool  # torchft's: whether this replica heals in the current quorum

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heal_checks: dict[str, Callable[[Any], Any]] = {}
        self._vetted: int | None = None  # id() of the received state last checked (a reference would pin it)
        self._quorum_observers: list[QuorumObserver] = []
        self._observed_quorum: object = None  # the quorum future last reported to the observers
        self._latest_request_may_heal = True  # what this process's latest quorum request asked for

    @override
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """As torchft's: ``state_dict()`` is sent to a healing peer under ``key``, which loads it with
        ``load_state_dict``. A key registered twice in one fit is refused with an error naming it: two parts of the
        fit would heal the same state (a callback given twice, or two that do one job). torchft only asserts.

        Raises:
            FTConfigError: ``key`` is registered already.
        """
        keys: set[str] = self.__dict__.setdefault("_heal_state_keys", set())  # torchft's __init__ may register one
        if key in keys:
            raise FTConfigError(
                f"lightning-ft: two parts of this fit register the heal state {key!r}: a callback is given twice, or "
                f"two callbacks do one job (DataPositionCallback is for sharded data, ExactlyOnceDataCallback for "
                f"data_mode='exactly_once'). Keep one."
            )
        keys.add(key)
        super().register_state_dict_fn(key, load_state_dict, state_dict)

    def register_heal_check(self, key: str, check: Callable[[Any], Any]) -> None:
        """``check(state)`` raises if the state received under ``key`` must not be loaded into this replica."""
        self._heal_checks[key] = check

    def add_quorum_observer(self, observer: QuorumObserver) -> None:
        """Tell ``observer`` of every quorum wait and every new quorum from now on."""
        self._quorum_observers.append(observer)

    @override
    def wait_quorum(self) -> None:
        """Wait for the quorum, as torchft does; tell the observers; then vet a heal right away: every cross-group
        collective (``allreduce``) waits here first, so a state that cannot be loaded stops this replica before it
        exchanges anything with its peers."""
        quorum = self._quorum_future  # waiting does not replace it
        if quorum is not None and quorum is self._observed_quorum and not profiler_enabled():
            # Called several times per step (the gradient hooks, num_participants, the vote): the observers hear of
            # a quorum only once a wait for it has returned its result, so this one is done and did not fail; a
            # wait takes no time and tells them nothing new.
            self._vet_heal()
            return
        # The clock bound at import (``from time import monotonic``): a test that patches the time module's clock
        # (Lightning's time-based validation, its throughput monitor) must see Lightning's own reads of it only.
        started = monotonic()
        try:
            if quorum is not None and quorum.done() and not profiler_enabled():
                # The quorum is known: torchft's wait_quorum is exactly this call, inside a profiler range whose
                # two torch ops are paid on each of the several calls per step (every bucket hook, the vote,
                # num_participants); without a profiler running there is no range to record.
                quorum.result()
            else:
                super().wait_quorum()
        finally:
            waited = monotonic() - started
            for observer in self._quorum_observers:
                observer.quorum_waited(waited)
        if quorum is not self._observed_quorum:  # torchft calls wait_quorum many times per quorum: report it once
            self._observed_quorum = quorum
            seen = QuorumSeen(
                quorum_id=self.quorum_id(),
                participants=self._participating_replica_world_size,
                replica_rank=self._participating_replica_rank,
            )
            for observer in self._quorum_observers:
                observer.quorum_formed(seen)
        self._vet_heal()

    @override
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Start the quorum as torchft does; at the job's very first step, heal before the forward pass.

        With an asynchronous quorum, torchft 0.2.0 counts every group at the job's highest step as a participant
        (``max_world_size``). At step 0 with ``init_sync`` that includes the groups that heal from the primary: they
        sit the step out (their gradient is zeroed), yet the average still divides by them, so the job's first
        update is ``1 / groups`` of what it should be. Healing them before the
        forward pass instead, as torchft's synchronous quorum does, makes every counted group contribute a gradient
        computed on the same weights. Only a process at step 0 waits for this quorum, and only a job at step 0 heals
        early: a restarted group behind a running job still heals inside the vote and is not counted.
        """
        self._latest_request_may_heal = allow_heal
        super().start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
        if not (self._use_async_quorum and allow_heal and self._step == 0):
            return
        self.wait_quorum()
        if self._healing and self._step == 0:  # the whole job is at step 0: torchft's init_sync heal
            self._apply_pending_state_dict()
            self._healing = False

    @property
    def latest_request_may_heal(self) -> bool:
        """Whether this process's latest quorum request let a behind replica heal in it (``allow_heal``): a training
        step's or a sync's does; a sync section's does not (:mod:`lightning_ft.step.collectives`), which is how
        :mod:`lightning_ft.manager.quorum_kind` tells the two apart."""
        return self._latest_request_may_heal

    def discard_heal(self, reason: Exception) -> None:
        """Load nothing of the state this replica received in the current quorum, and fail the step: ``reason`` says
        why (the peer it came from belongs to another job). The next quorum heals it again, from another peer."""
        self._pending_state_dict = None
        self.report_error(reason)

    def quorum_id(self) -> int:
        """The id of the latest quorum (-1 before the first). torchft 0.2.0 has no accessor for it."""
        return -1 if self._quorum_id is None else int(self._quorum_id)

    @override
    def _apply_pending_state_dict(self) -> None:
        """Vet, then load as torchft does. Reached even when no collective ran (a failed fetch skips them)."""
        assert self._quorum_future is not None, "must call start_quorum before applying a heal"
        self._quorum_future.result()
        self._vet_heal()
        super()._apply_pending_state_dict()
        self._vetted = None  # an id() may be reused by a later, unvetted state

    def _vet_heal(self) -> None:
        """Raise if this replica heals and the received state must not be loaded; a no-op otherwise."""
        if not self._healing:
            return
        pending = self._pending_state_dict
        if pending is None:
            error = self.errored()
            if error is not None and isinstance(error.original_exception, RefusedPeerStateError):
                raise error.original_exception  # the same bytes would be refused at every retry
            return
        if id(pending) == self._vetted:
            return
        user_state = pending["user"]
        for key, check in self._heal_checks.items():
            check(user_state[key])
        self._vetted = id(pending)

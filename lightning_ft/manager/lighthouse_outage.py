"""Riding out a lighthouse outage: stall with a clear message, resume when a lighthouse is back at the same address.

What torchft 0.2.0 does on its own when the lighthouse dies (measured, or read in its ``manager.rs``; see
``docs/reliability.md``, "Lighthouse loss"):

* The group's ManagerServer asks the lighthouse for a quorum, the request fails at once, and with the default
  ``quorum_retries=0`` it *swallows* that error (``manager.rs``: "we don't broadcast in cases when this method
  returns an error, resulting in a hang"). Every rank's quorum RPC then waits out its whole ``quorum_timeout`` and
  raises ``TimeoutError: status: Cancelled, message: "Timeout expired"``, which is indistinguishable from slow peers.
* That error escapes from the first ``wait_quorum()`` (the gradient hook, or ``start_quorum()`` with a synchronous
  quorum): the process exits, torchrun restarts it, and the restarted Manager cannot even be built while the
  lighthouse is down. When the lighthouse is back, every group starts over from step 0 (or the last checkpoint).
* ``quorum_retries > 0`` does not help (read, not measured): after a refused connection the ManagerServer sleeps a whole
  ``quorum_timeout`` before retrying, by which time the client has given up; a late answer then reaches the next
  request.
* The ManagerServer's connections to the lighthouse do come back: heartbeats reconnect on their own, and a quorum
  request issued once the lighthouse is back at the same address succeeds.

So the retry lives here, around the one RPC that depends on the lighthouse: the Manager's quorum request to its
ManagerServer. While a request is pending for longer than a second, a watchdog thread probes the lighthouse's TCP
port once a second (the request itself runs on torchft's quorum thread, as it would without this module: a thread
hand-off per step cost more CPU than anything else this module does, see ``docs/benchmarks.md``). A request that fails
while the lighthouse was unreachable is not an error of the job but an outage: the group logs one warning (which
lighthouse, that training is stalled, how to fix it), waits until the lighthouse has been reachable for a short
grace (so that every group's heartbeats are back and the groups rejoin in one quorum), and asks again for the *same*
step. Until a quorum forms, each request is bounded by ``quorum_timeout`` and the whole outage by
``lighthouse_outage_timeout``. Nothing was exchanged and nothing committed meanwhile, so no step is lost or applied
twice.

**The request the outage left hanging.** A request in flight when the lighthouse dies is doomed: once every rank
of the group has asked, the ManagerServer forwards one request to the lighthouse, that fails, and the ManagerServer
answers nobody, so each rank's request would run out its whole ``quorum_timeout`` (60 s by default) however short the
outage. But the ManagerServer answers *every* pending request of a rank when the group's next quorum forms (it
broadcasts the lighthouse's answer to every waiting request). So once a lighthouse that was seen unreachable during a
request has been back for the rejoin grace, the watchdog asks again for the same step from a fresh connection
(:func:`~lightning_ft.manager.internals.new_manager_client`), on a thread of its own. With every rank of the group
doing the same, the group's next quorum forms and answers the hanging request too: training resumes about the
rejoin grace after the lighthouse is back, whatever ``quorum_timeout`` is. The rescue's own answer is dropped.

The ManagerServer keeps one request per group rank until every rank has asked. A rescue therefore goes out only for a
request that was pending while a probe failed: for a one-process group that request had been forwarded (it forwards
at once) and is surely doomed. In a group of several processes a rank whose peers had not asked yet when the
lighthouse died may still be answered by their requests; the rescue comes a rejoin grace later, by when those peers
have asked (a quorum request follows the step by milliseconds), so it joins their set or the next one rather than
lingering. If a rescue finds the hanging request already answered, its entry would pair with the next step's
requests: the window is the few milliseconds between the check and the rescue's arrival.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lightning_ft.errors import LightningFTError
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

# How often to probe the lighthouse while a quorum request is pending or the lighthouse is down. Quorums that take
# longer than this are rare in steady state (one per step takes milliseconds), so normal training never probes.
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
# How long a returned lighthouse must have been seen reachable before a group asks it again. A fresh lighthouse knows
# no one: a request that reaches it before the other groups' heartbeats do makes a quorum of that group alone, and the
# others then heal from it (or, worse, torchft reuses a quorum id for another membership, see docs/reliability.md).
# torchft's heartbeat loop reconnects with an exponential backoff capped at 10 s (plus up to 100 ms of jitter); after
# that every live group is heartbeating again, and the groups rejoin in one quorum at the step where they stopped.
REJOIN_GRACE_S = 11.0


@dataclass
class PendingRequest:
    """A quorum request in flight, as the watchdog sees it."""

    since: float
    request: dict[str, Any]
    doomed: bool = False  # a probe failed while it was pending: the ManagerServer will not answer it
    rescued: bool = False  # a rescue went out since the lighthouse last came back

    @property
    def step(self) -> int | None:
        return self.request.get("step")


class LighthouseUnavailableError(LightningFTError, RuntimeError):
    """No quorum formed within ``lighthouse_outage_timeout`` of the lighthouse becoming unreachable."""


def lighthouse_reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the lighthouse at ``url`` accepts TCP connections.

    A bare connect, not an RPC: a heartbeat would register a replica the lighthouse then waits for, and a quorum
    request would join one. A dead lighthouse on a live host refuses at once; a dead host times out.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=timeout):
            return True
    except OSError:
        return False


class OutageTolerantClient:
    """Wraps the Manager's ``ManagerClient``: its quorum request outlasts a lighthouse outage; all else passes through.

    Args:
        client: torchft's ``ManagerClient`` of this rank.
        lighthouse: The lighthouse URL, as every group was given it.
        outage_timeout: Seconds a single outage may last before the quorum fails with
            :class:`LighthouseUnavailableError`; ``None`` waits for as long as it takes.
        reachable: Probe of the lighthouse (replaceable in tests).
        clock: Time source (replaceable in tests).
        sleep: Sleep (replaceable in tests).
        probe_interval: Seconds between probes while a request is pending or the lighthouse is down.
        rejoin_grace: Seconds a returned lighthouse must have been reachable before the request is made again.
        new_client: Makes a fresh client to the same ManagerServer, for the rescue of a request the outage left
            hanging; ``None``: no rescue, the hanging request runs out its timeout.
    """

    def __init__(
        self,
        client: Any,
        lighthouse: str,
        outage_timeout: float | None,
        reachable: Callable[[str], bool] = lighthouse_reachable,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        probe_interval: float = PROBE_INTERVAL_S,
        rejoin_grace: float = REJOIN_GRACE_S,
        new_client: Callable[[], Any] | None = None,
    ) -> None:
        self._client = client
        self._lighthouse = lighthouse
        self._outage_timeout = outage_timeout
        self._reachable = reachable
        self._clock = clock
        self._sleep = sleep
        self._probe_interval = probe_interval
        self._rejoin_grace = rejoin_grace
        self._outage_since: float | None = None  # set from the first failed probe until a quorum succeeds
        self._up_since: float | None = None  # the first successful probe since the latest failed one
        self._state = threading.Lock()  # the outage record is written by the requesting thread and the watchdog
        self._new_client = new_client
        self._pending: PendingRequest | None = None  # the request in flight
        self.rescues = 0  # rescues sent (read by tests)
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **request: Any) -> Any:
        """torchft's quorum request, asked again for the same step until a quorum forms after a lighthouse outage.

        Outside an outage a failure is torchft's to report, unchanged. Once the lighthouse was seen unreachable, the
        outage lasts until a quorum succeeds: the first requests to a fresh lighthouse may fail too (it holds a lone
        group back while others heartbeat), and each one is bounded by ``quorum_timeout``.
        """
        step = request.get("step")
        while True:
            outcome = self._attempt(request)
            if not isinstance(outcome, BaseException):
                self._end_outage(step)
                return outcome
            if self._outage_since is None and self._probe():
                raise outcome  # the lighthouse was up throughout: not an outage, torchft's error stands
            self._begin_outage(step)
            self._wait_for_lighthouse(outcome)

    def _attempt(self, request: dict[str, Any]) -> Any:
        """One quorum request, on the calling thread; the watchdog probes the lighthouse while it is pending.
        Returns its result or its error."""
        self._start_watchdog()
        self._pending = PendingRequest(self._clock(), request)
        try:
            return self._client._quorum(**request)
        except Exception as error:
            return error
        finally:
            self._pending = None

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="lightning_ft_lighthouse_watch", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        """Once per probe interval: if a request has been pending that long, probe. An unreachable lighthouse starts
        the outage (its warning) and dooms the request; once the lighthouse has been back for the rejoin grace, the
        doomed request is rescued."""
        while not self._stopped.wait(self._probe_interval):
            pending = self._pending
            if pending is None or self._clock() - pending.since < self._probe_interval:
                continue
            self._check(pending)

    def _check(self, pending: PendingRequest) -> None:
        if not self._probe():
            pending.doomed, pending.rescued = True, False
            self._begin_outage(pending.step)
        elif pending.doomed and not pending.rescued and self._back_for(self._rejoin_grace):
            pending.rescued = True
            if self._new_client is not None and self._pending is pending:
                self._rescue(pending)

    def _back_for(self, seconds: float) -> bool:
        with self._state:
            return self._up_since is not None and self._clock() - self._up_since >= seconds

    def _rescue(self, pending: PendingRequest) -> None:
        """Ask again for the pending request's step from a fresh connection, on a thread of its own: the quorum it
        forms answers the hanging request as well (see the module docstring). Its own answer or error is dropped."""
        assert self._new_client is not None
        new_client = self._new_client
        self.rescues += 1
        log.info(
            "lightning-ft: the lighthouse at %s is back; asking again for the quorum of step %s, which the outage left "
            "without an answer.",
            self._lighthouse,
            pending.step,
        )
        events.emit("quorum_rescue", lighthouse=self._lighthouse, step=pending.step)

        def ask() -> None:
            try:
                new_client()._quorum(**pending.request)
            except Exception as error:  # the hanging request reports its own outcome; this one is only a nudge
                log.debug("lightning-ft: the rescue request for step %s failed: %s", pending.step, error)

        threading.Thread(target=ask, name="lightning_ft_quorum_rescue", daemon=True).start()

    def _probe(self) -> bool:
        reachable = self._reachable(self._lighthouse)
        returned = None
        with self._state:
            if not reachable:
                self._up_since = None
            elif self._up_since is None:
                self._up_since = self._clock()
                if self._outage_since is not None:
                    returned = self._up_since - self._outage_since
        if returned is not None:
            events.emit("lighthouse_reachable", lighthouse=self._lighthouse, unreachable_s=round(returned, 3))
        return reachable

    def _wait_for_lighthouse(self, cause: BaseException) -> None:
        """Block until the lighthouse has been reachable for the rejoin grace, or fail once the outage outlasts the
        limit."""
        while True:
            assert self._outage_since is not None
            stalled = self._clock() - self._outage_since
            if self._outage_timeout is not None and stalled > self._outage_timeout:
                raise LighthouseUnavailableError(
                    f"lightning-ft: no quorum for {stalled:.0f}s since the lighthouse at {self._lighthouse} became "
                    f"unreachable, longer than lighthouse_outage_timeout={self._outage_timeout:g}s; giving up. "
                    f"Restart the lighthouse at the same address (e.g. `lightning-ft lighthouse --bind <host:port>`), "
                    f"or raise FTStrategy(lighthouse_outage_timeout=...) to let the job wait longer."
                ) from cause
            if self._probe() and self._back_for(self._rejoin_grace):
                return
            self._sleep(self._probe_interval)

    def _begin_outage(self, step: int | None) -> None:
        """Record the outage and warn, once per outage."""
        with self._state:
            if self._outage_since is not None:
                return
            self._outage_since = self._clock()
        limit = (
            "no limit" if self._outage_timeout is None else f"up to lighthouse_outage_timeout={self._outage_timeout:g}s"
        )
        log.warning(
            "lightning-ft: the lighthouse at %s is unreachable; training is stalled at committed step %s and will "
            "resume when a lighthouse is back at that address (waiting %s). To fix: restart the lighthouse at the "
            "same address, e.g. `lightning-ft lighthouse --bind <host:port>`. No committed step is lost meanwhile.",
            self._lighthouse,
            step,
            limit,
        )
        events.emit("lighthouse_unreachable", lighthouse=self._lighthouse, step=step)

    def _end_outage(self, step: int | None) -> None:
        with self._state:
            if self._outage_since is None:
                return
            stalled = self._clock() - self._outage_since
            self._outage_since = None
        log.info(
            "lightning-ft: the lighthouse at %s is back; training resumes at committed step %s after a %.1fs stall.",
            self._lighthouse,
            step,
            stalled,
        )
        events.emit("lighthouse_back", lighthouse=self._lighthouse, step=step, stalled_s=round(stalled, 3))

    def shutdown(self) -> None:
        self._stopped.set()

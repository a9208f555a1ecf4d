"""Every member of a new quorum arrives before the process group's rendezvous, or the quorum is given up in time.

The failure this answers: a replica group asks for a quorum and dies before the quorum forms. Its heartbeats are
still fresh, so the lighthouse puts it in the quorum, and every member then builds the cross-group process group
through the quorum's store. Gloo's rendezvous waits for the dead member's address until the process group's timeout
(``FTStrategy(timeout=...)``, 60 s by default), inside native code where it cannot be given up: a thread still in
the rendezvous when the process exits returns into Python during interpreter shutdown and aborts the process.
(A dead *primary* member, whose store is gone, fails at once: :mod:`lightning_ft.process_group.quorum_store`.)

So before the rendezvous each member announces itself in the quorum's store (one key per member, under the process
group's own prefix) and waits, in Python and in short slices, until every member has. Members of one quorum receive
it from the lighthouse at the same moment and arrive within milliseconds of each other; a member still missing after
``grace`` seconds is dead or stopped. One decision per quorum, set atomically by whichever member makes it first
(``compare_set``: "complete", or why it was given up), is what every member follows, so none enters the rendezvous
of a quorum that another has given up. A given-up quorum raises :class:`QuorumMemberMissingError` in every member:
torchft's quorum reports it, the step does not commit, and the next quorum is formed without the missing group once
the lighthouse's heartbeat timeout has passed. A member alive but slower than ``grace`` costs one uncommitted step
for the quorum, and is in the next one.

With ``lightning-ft launch``'s lighthouse (1-s heartbeat timeout) the survivors form the next quorum about 1.3 s
after the kill; the 1-s grace is sized to stay within that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.distributed import Store

from lightning_ft.errors import LightningFTError
from lightning_ft_job import events

ARRIVED_PREFIX = "lightning_ft/arrived/"
# Set once per quorum, atomically (``compare_set``): every member follows the first decision, so no member enters
# the rendezvous of a quorum that another has given up.
DECISION_KEY = "lightning_ft/arrival"
COMPLETE = "complete"
# How long a member waits for the others after arriving itself.
GRACE_S = 1.0
POLL_S = 0.01


class QuorumMemberMissingError(LightningFTError, RuntimeError):
    """A member of the new quorum never arrived at its process group's rendezvous."""


def arrived_key(rank: int) -> str:
    return f"{ARRIVED_PREFIX}{rank}"


def wait_for_every_member(
    store: Store,
    rank: int,
    world_size: int,
    quorum_id: int | None,
    grace: float = GRACE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Announce ``rank`` in the quorum's ``store`` and return once all ``world_size`` members have; raise
    :class:`QuorumMemberMissingError` when one is still missing after ``grace`` seconds (or another member decided
    so first). Errors of the store itself propagate (its primary is gone: the quorum cannot form either)."""
    if world_size <= 1:
        return
    store.set(arrived_key(rank), "1")
    everyone = [arrived_key(r) for r in range(world_size)]
    started = clock()
    while True:
        proposal = None
        if store.check(everyone):
            proposal = COMPLETE
        elif clock() - started >= grace:
            missing = [r for r in range(world_size) if not store.check([arrived_key(r)])]
            proposal = (
                f"replica rank(s) {missing} of quorum {quorum_id} did not reach its process group within "
                f"{grace:.1f}s (their group died after asking for the quorum, or is stopped)"
            )
        if proposal is not None:
            decision = store.compare_set(DECISION_KEY, "", proposal).decode(errors="replace")
        elif store.check([DECISION_KEY]):
            decision = store.get(DECISION_KEY).decode(errors="replace")
        else:
            decision = ""
        if decision:
            if decision == COMPLETE:
                return
            events.emit(
                "quorum_member_missing", quorum_id=quorum_id, reason=decision, waited_s=round(clock() - started, 3)
            )
            raise QuorumMemberMissingError(
                f"lightning-ft: {decision}; giving quorum {quorum_id} up. This step will not commit; the next "
                f"quorum goes on without them."
            )
        sleep(POLL_S)

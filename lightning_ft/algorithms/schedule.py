"""When a semi-synchronous group syncs: :class:`SyncSchedule`, the decisions of LocalSGD and DiLoCo's sync points.

The schedule only decides; :class:`~lightning_ft.algorithms.sync_owner.SyncOwner` carries its decisions out in
Lightning's loop (opening the quorum, starting a fragment's allreduce, averaging and voting). Every decision is a
function of the inner step (``trainer.global_step``) and of the syncs already opened and taken, which every group of
the job shares, so every group decides alike.

A sync sits at the start of the batch that follows every ``period``-th inner step (``sync_every``, or
``sync_every / fragments`` for streaming DiLoCo). With a ``delay`` (``fragment_sync_delay``, τ) it comes in two
halves: it opens τ inner steps before the sync step, with its fragment's allreduce overlapping those inner steps, and
finishes at the sync step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What a group's first batch does with the quorum it opened (SyncSchedule.join).
JoinMove = Literal["finish", "release", "prepare"]


@dataclass
class SyncSchedule:
    """The sync points of one fit.

    Args:
        period: Inner steps between two syncs (``AlgorithmSettings.sync_period``).
        delay: Inner steps a sync's allreduce overlaps (``fragment_sync_delay``); ``0``: a sync is taken whole.
    """

    period: int
    delay: int = 0
    opened_at: int | None = None  # the inner step at which the latest sync's quorum opened
    last_sync_step: int | None = None  # the inner step of the latest sync taken

    @property
    def overlapped(self) -> bool:
        """Whether a sync opens with its allreduce in flight (finished ``delay`` inner steps later)."""
        return self.delay > 0

    def opened(self, step: int) -> None:
        self.opened_at = step

    def finished(self, step: int) -> None:
        self.last_sync_step = step

    def join(self, step: int, committed_syncs: int) -> JoinMove:
        """What a process lifetime's first batch does with the quorum it opened, at inner step ``step`` with the
        Manager at ``committed_syncs``:

        * ``"finish"``: take a whole sync here: the job's start (``init_sync`` makes every group identical), or a
          restarted group healed to its peers' sync step;
        * ``"prepare"``: the first half of a delayed sync whose opening step this is;
        * ``"release"``: no sync here: every group resumed between two syncs (or inside a delayed sync's overlap,
          which is redone from the resume point); the schedule goes on as if the job had never stopped.
        """
        since_opening = (step + self.delay) % self.period  # inner steps since the latest sync's opening step
        if committed_syncs == 0 or (since_opening == 0 and not self.delay):
            return "finish"
        if since_opening > self.delay:
            return "release"
        if step % self.period == 0:
            return "finish"
        return "prepare"

    def finishes_in_flight(self, step: int) -> bool:
        """With a sync in flight: whether this batch start is its sync step."""
        return step % self.period == 0 and step != self.opened_at

    def opens(self, step: int) -> bool:
        """With no sync in flight: whether a sync opens at this batch start."""
        return (step + self.delay) % self.period == 0 and step != self.opened_at

    def ends_with_final_syncs(self, step: int) -> bool:
        """At the end of training: whether the last inner step is a sync step not yet synced, so that every fragment
        syncs once more and no group keeps local values. Otherwise the last inner steps stay local."""
        return step % self.period == 0 and step != self.last_sync_step

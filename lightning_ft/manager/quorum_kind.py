"""Every process group a new quorum configures starts with one exchange: which kind of quorum each member asked for.

Two kinds of request meet at the lighthouse. A training step (or a semi-synchronous sync) asks for a quorum in which a
behind group may heal; a sync section (validation, an epoch end, the replica consistency check) asks for one in which
none may (``allow_heal=False``, :mod:`lightning_ft.step.collectives`), and asks again after one of its collectives
failed. The lighthouse forms one quorum out of whatever requests it holds, whoever made them. When a group dies
inside a section's collective, a ring allreduce can complete for one survivor and fail for another: the first goes
on to its next training step, the second asks for a quorum to take the section's collective again, and the two meet
in one quorum. On its new process group the first would send its gradients and the second the section's handshake.
Gloo pairs collectives by their order on a group and refuses two of different sizes by aborting the receiving
process (``EnforceNotMet`` in its transport thread): a healthy survivor killed because another group died.

So every member of a new quorum, before anything else goes over that quorum's process group, sums two counts over
it: the members that asked for a section, and those that asked for a step. Each member does this first, so it pairs
with nothing but itself. A quorum that holds both kinds fails for each of its members (:class:`MixedQuorumError`,
reported to the Manager): the step does not commit, and the section's attempt fails before either sends anything
else on that group. The step's failed vote gives the next quorum a new id, which checks again; a section that meets
steps at each of its attempts falls back to its group's own value (``CrossGroupCollectives``), and every group then
trains on. Nothing is aborted, and no quorum mixes what it sums.

"New quorum" is torchft's own rule for reconfiguring the process group: a quorum id other than the one before. So the
exchange costs one small allreduce per membership change or failed vote, and nothing on a step whose quorum did not
change. What it cannot see: a section and a step that meet in a quorum whose id did not change (no member left or
joined, and no vote failed since the section's collective did): the process group is then the old one, not new to
either member. That takes a section collective that failed on one member, completed on another, and lost nobody.
"""

from __future__ import annotations

import torch

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.ft_manager import FTManager, QuorumSeen
from lightning_ft.manager.internals import CROSS_GROUP_SUM, cross_group_process_group, crosses_groups_over_gloo
from lightning_ft_job import events

# The exchange's buffer: [members that asked for a sync section, members that asked for a training step or sync].
_SECTION, _STEP = 0, 1


class MixedQuorumError(LightningFTError, RuntimeError):
    """This quorum holds groups that asked for a training step and groups that asked for a sync section."""


def install_quorum_kind_check(manager: FTManager, device: torch.device) -> QuorumKindCheck:
    """Make every new quorum of ``manager`` check its members' kinds first (before any other observer exchanges)."""
    check = QuorumKindCheck(manager, device)
    manager.add_quorum_observer(check)
    return check


class QuorumKindCheck:
    """A :class:`~lightning_ft.manager.ft_manager.QuorumObserver`: at each new quorum id, the kinds of its members.

    Args:
        manager: This group's Manager (its latest quorum request says this member's kind).
        device: The group's device: where an NCCL cross-group process group runs (Gloo's exchange stays on the CPU).
    """

    def __init__(self, manager: FTManager, device: torch.device) -> None:
        self.manager = manager
        self.device = device
        self._checked_quorum_id: int | None = None

    def quorum_waited(self, seconds: float) -> None:
        """Not needed here."""

    def quorum_formed(self, quorum: QuorumSeen) -> None:
        """On a new quorum id (a process group just configured), exchange kinds; report a mixed quorum as the step's
        error. A failed exchange (a member died in it) fails the step like any collective."""
        if quorum.quorum_id == self._checked_quorum_id:
            return
        self._checked_quorum_id = quorum.quorum_id
        manager = self.manager
        asked_for_section = not manager.latest_request_may_heal
        device = torch.device("cpu") if crosses_groups_over_gloo(manager) else self.device
        counts = torch.zeros(2, dtype=torch.int64, device=device)
        counts[_SECTION if asked_for_section else _STEP] = 1
        try:
            cross_group_process_group(manager).allreduce([counts], CROSS_GROUP_SUM).wait()
        except Exception as error:  # a member died or timed out: nothing more goes over this group
            manager.report_error(error)
            return
        sections, steps = (int(count) for count in counts.tolist())
        if not (sections and steps):
            return
        events.emit(
            "mixed_quorum", quorum_id=quorum.quorum_id, sections=sections, steps=steps, step=manager.current_step()
        )
        mine = "a sync section's" if asked_for_section else "a training step's"
        manager.report_error(
            MixedQuorumError(
                f"lightning-ft: quorum {quorum.quorum_id} holds {steps} replica group(s) in a training step and "
                f"{sections} in a sync section (a group died inside the section's collective, which completed for "
                f"some groups only); this member asked for {mine}. Nothing is exchanged on it: this attempt fails, "
                f"and the next quorum is checked again."
            )
        )

"""The job's last step is committed by one set of groups: the check a group makes before it votes on its last step.

Why: the lighthouse forms a quorum without a group whose request comes late (a process that froze long enough for
its heartbeat to lapse, or that asked after the join timeout). Before the last step this costs nothing: the late group
heals from the others at its next quorum. After the last step there is no next quorum: the others finish, and the
late group, still one step behind, would commit the last step in a quorum of its own and end as a second model.

The same holds for a semi-synchronous job's final syncs (LocalSGD, DiLoCo): a group left out of its peers' final
syncs would sync alone. So a group whose vote would end its fit (``max_steps`` or the last batch of ``max_epochs``: a
step, or a final sync), in a quorum that lacks some of the job's groups, first looks at the groups outside its quorum
(on group rank 0, broadcast in the group so that every rank acts alike):

1. **One of them reported the run's end at this step or later** (:mod:`lightning_ft_job.run_end`): the job ended
   without this group. It stops like a group restarted after the end: one line, the ``job_already_finished`` event,
   exit 0, no final state (:class:`~lightning_ft.start.decision.JobAlreadyFinished`).
2. **Else one of them still heartbeats**: it may be finishing this very step in another quorum (a group writes its
   report before its Manager stops heartbeating), or it is alive and late. This group votes not to commit
   (:class:`LastStepDeferred`) and asks for a new quorum, which the late group can join; the step (or the final sync)
   is taken again. For at most :data:`LAST_STEP_WAIT_S` (and fewer times in a row than ``max_retries``, after which
   torchft would stop the group); then it commits (an outsider that comes later finds its report: rule 1). The groups
   of the quorum take it again together: each reads the lighthouse at its own moment, so they sum their deferrals
   over the quorum's process group, and one group's deferral is all of theirs.
3. **Else** it commits.

The lighthouse's heartbeats are read before the reports: a finisher whose heartbeat is seen lapsed had written its
report by then. What the check cannot see: a finisher frozen between its commit and its report for longer than a
heartbeat timeout. The lighthouse's status page unreadable: the check stops nobody and the group commits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed import ReduceOp
from torchft import Manager

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable, read_lighthouse_status
from lightning_ft.manager.quorum_members import quorum_groups
from lightning_ft.settings import FTSettings
from lightning_ft.start.decision import job_already_finished
from lightning_ft_job import events
from lightning_ft_job.run_end import GroupFinished

log = logging.getLogger("lightning.pytorch.lightning_ft")

#: How long a group keeps taking its last step again while a group outside its quorum heartbeats and has not reported.
LAST_STEP_WAIT_S = 60.0


class LastStepDeferred(LightningFTError, RuntimeError):
    """This group does not commit its last step yet: a group outside its quorum may be ending the job at it."""


def deferred_last_step(manager: Manager) -> bool:
    """Whether the Manager's latest vote was not to commit because a late group may yet join (not a failure)."""
    error = manager.errored()
    return error is not None and isinstance(error.original_exception, LastStepDeferred)


@dataclass(frozen=True)
class LastVote:
    """What a group does at its last vote (picklable: it is broadcast inside the group)."""

    ended: GroupFinished | None = None  # a group outside the quorum ended the job at or after this step: stop
    heartbeating: tuple[int, ...] = ()  # groups outside the quorum that still heartbeat: take the step again


def last_vote(
    status: LighthouseStatus,
    reports: dict[int, GroupFinished],
    members: set[int],
    prefix: str,
    step: int,
) -> LastVote:
    """The rule of this module, for a quorum of ``members`` whose vote would commit ``step``."""
    ended = [report for group, report in sorted(reports.items()) if group not in members and report.step >= step]
    if ended:
        return LastVote(ended=ended[0])
    return LastVote(heartbeating=tuple(sorted(status.fresh_groups(prefix) - members)))


class LastStepCheck:
    """Made at every vote of a group's fit, a step's or a sync's
    (:meth:`~lightning_ft.step.protocol.StepProtocol.check_before_vote`); it acts only at the fit's last step or final
    syncs, in a quorum without every group of the job.

    Args:
        trainer: The fitting trainer: whether this step ends the fit.
        settings: The group's settings (id, job size, replica id prefix, lighthouse).
        group_rank: This process's rank in its group; rank 0 reads the lighthouse and the reports.
        broadcast: The group's broadcast from rank 0.
        reports: This run's end reports (:func:`lightning_ft_job.run_end.finished_groups`).
        read_status: The lighthouse reader (replaceable in tests).
        clock: The clock (replaceable in tests).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        settings: FTSettings,
        group_rank: int,
        broadcast: Callable[[Any], Any],
        reports: Callable[[], dict[int, GroupFinished]],
        read_status: Callable[[str], LighthouseStatus] = read_lighthouse_status,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._trainer = trainer
        self._settings = settings
        self._group_rank = group_rank
        self._broadcast = broadcast
        self._reports = reports
        self._read_status = read_status
        self._clock = clock
        self._deferring_since: float | None = None
        self._deferrals = 0

    def ends_the_fit(self) -> bool:
        """Whether committing the step now voted on ends the fit: ``max_steps`` reached, or the last batch of the
        last epoch (a semi-synchronous job's final syncs run at ``max_steps``, so they count too)."""
        trainer = self._trainer
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return True
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        return bool(last_epoch and trainer.is_last_batch)

    def before_vote(self, manager: Manager) -> bool:
        """Stop, vote not to commit (``False``, the error reported to ``manager``), or let the vote go on (``True``);
        see the module's rule. ``step`` here is the Manager's: committed steps, or syncs for LocalSGD and DiLoCo."""
        settings = self._settings
        if settings.lighthouse is None or settings.num_replica_groups < 2 or not self.ends_the_fit():
            return True
        manager.wait_quorum()  # its answer names the members (an asynchronous quorum has arrived by the vote anyway)
        members = quorum_groups(manager, settings.replica_id_prefix)
        if members is None or len(members) >= settings.num_replica_groups:
            return True
        step = manager.current_step() + 1
        verdict = self._broadcast(self._decide(members, step) if self._group_rank == 0 else None)
        group = settings.replica_group_id
        if verdict is not None and verdict.ended is not None:
            report = verdict.ended
            message = (
                f"lightning-ft: replica group {group} stops before its last step: replica group {report.group} ended "
                f"run {report.run_id} at committed step {report.step} ({report.reason}) in a quorum without it. Its "
                f"final state is the job's; this group writes none and exits 0."
            )
            log.warning(message)
            events.emit("job_already_finished", step=report.step, directory=None, run=report.run_id)
            raise job_already_finished(report.step, message)
        # Every group of the quorum decides alike, or one would commit the last step and another take it again: each
        # reads the lighthouse at its own moment, and an outsider's heartbeat may lapse between two reads.
        if not _any_defers(manager, verdict is not None, self._trainer.strategy.root_device):
            self._deferring_since, self._deferrals = None, 0
            return True
        verdict = verdict if verdict is not None else LastVote(heartbeating=())
        events.emit("last_step_deferred", step=step, heartbeating=list(verdict.heartbeating))
        manager.report_error(
            LastStepDeferred(
                f"lightning-ft: replica group {group} takes its last step (committed step {step}) again: "
                + (
                    f"replica group(s) {', '.join(map(str, verdict.heartbeating))} outside its quorum still heartbeat "
                    f"and may be ending the job there"
                    if verdict.heartbeating
                    else "a group of its quorum saw a group outside it still heartbeat"
                )
            )
        )
        return False

    def _decide(self, members: set[int], step: int) -> LastVote | None:
        """Rank 0's verdict: ``None`` lets the vote go on."""
        lighthouse = self._settings.lighthouse
        assert lighthouse is not None
        try:
            status = self._read_status(lighthouse)  # before the reports: see the module's docstring
        except StatusPageUnreadable as error:
            log.warning("lightning-ft: cannot check the groups outside the last step's quorum: %s", error)
            return None
        verdict = last_vote(status, self._reports(), members, self._settings.replica_id_prefix, step)
        if verdict.ended is not None:
            return verdict
        if not verdict.heartbeating:
            return None
        now = self._clock()
        if self._deferring_since is None:
            self._deferring_since = now
        # torchft stops a group after max_retries uncommitted votes in a row: a deferral must never be the last one.
        max_retries = self._settings.max_retries
        if now - self._deferring_since >= LAST_STEP_WAIT_S or (
            max_retries is not None and self._deferrals + 1 >= max_retries
        ):
            log.warning(
                "lightning-ft: replica group(s) %s outside the last step's quorum still heartbeat after %.0f s; "
                "committing the last step without them (if they reach it, they find this group's end report).",
                ", ".join(map(str, verdict.heartbeating)),
                now - self._deferring_since,
            )
            return None
        self._deferrals += 1
        return verdict


def _any_defers(manager: Manager, defers: bool, device: torch.device) -> bool:
    """Whether any group of the quorum takes its last step again: a sum over the quorum's process group (every rank
    of a group holds its group's verdict; on ``device``, where that process group runs). A failed exchange counts
    as a deferral: the step is not committed anywhere it failed, and is taken again."""
    flag = torch.tensor([1.0 if defers else 0.0], device=device)
    manager.allreduce(flag, reduce_op=ReduceOp.SUM).wait()
    return manager.errored() is not None or bool(flag.item() > 0)

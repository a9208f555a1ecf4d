"""Where a replica group starts from: one job, one model, whoever starts first, restarts late or comes after the end.

A group that starts while no live peer is ahead of it would otherwise form a quorum alone and train from its own
initial (or stale) weights as if it were the whole job: a second model, silently. This module decides, once per
process and before the first quorum, on the group's rank 0 (the decision is broadcast in the group):

1. **After the end.** If a group of this run reported the run's end (:mod:`lightning_ft_job.run_end`), or the job's
   record (:mod:`lightning_ft.start.record`) says it finished under the same limits, the group stops at once
   (:class:`JobAlreadyFinished`, which ends an uncaught process with exit code 0), before it registers with the
   lighthouse: no training, no logging, no checkpoint.
   This holds whatever engine started it, and it is checked again on every poll of the wait below: a group restarted
   just before its peers finished learns of the end while it waits, instead of waiting ``start_timeout`` for peers
   that are gone.
2. **A coherent start.** Until every one of ``num_replica_groups`` groups heartbeats to the lighthouse, a group
   waits (``start_timeout``), unless the job is already under way: a member of the last quorum of another group is
   still alive, so this group is a late joiner and heals from it. When the timeout expires, the job starts with the
   groups present, with one warning naming the missing ones; they join and heal later. ``start_timeout=0`` starts
   as soon as this group is up.
3. **Never older than the job.** The job's newest durable state is its newest checkpoint. A group given no
   ``ckpt_path`` (a given one is the user's choice, and wins) resumes from it unless a live peer is already at or
   past it (the group then heals from that peer and reads nothing from disk). Either way the group's first quorum
   must reach the checkpoint's step: if the peer it counted on has died meanwhile, the group stops
   (:class:`~lightning_ft.step.protocol.JobBehindCheckpointError`, raised by the step protocol's floor check) and
   its restart resumes from the checkpoint, rather than taking the job back to an older state.
4. **No record at all.** A restarted group (a torchrun restart, or a new process joining a job whose last quorum it
   can see) that finds no live peer after waiting ``start_timeout`` stops with :class:`NoLivePeerError`: training
   on alone would start the job over from this group's initial weights. If it found one, its first quorum must
   reach the step of the job's last quorum, as in 3: if that peer died meanwhile, the group stops, and its restart
   finds no live peer.

What the lighthouse knows comes from its status page (:mod:`lightning_ft.manager.lighthouse_status`). If it cannot be
read, the group warns once and starts without waiting.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ft.errors import LightningFTError
from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable, read_lighthouse_status
from lightning_ft.start.record import FinishedJob, JobRecord
from lightning_ft_job import events
from lightning_ft_job.run_end import GroupFinished

log = logging.getLogger("lightning.pytorch.lightning_ft")

POLL_INTERVAL_S = 0.2


class JobAlreadyFinished(LightningFTError):
    """The run this group belongs to has already finished, at committed step ``step``, so the group did not train (or
    did not take the last step): ``message`` is the one line it printed.

    A caller may catch it like any exception. Left uncaught, it ends the process with exit code 0, not 1: an engine
    that started the group again after the end (torchrun, a scheduler) then counts the group as done instead of
    starting it once more (:func:`job_already_finished`).

    Attributes:
        step: The committed step at which the run finished.
        message: The line the group printed, naming the run and where it finished.
    """

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


def job_already_finished(step: int, message: str) -> JobAlreadyFinished:
    """The exception to raise (its line logged by the caller), with the process made to exit 0 should nobody catch
    it: Python ends a program with an uncaught exception by calling ``sys.excepthook`` and then exiting 1; the hook
    installed here (once, ahead of the one it finds) exits 0 for this exception, without a traceback, and passes any
    other one on."""
    previous = sys.excepthook
    if not getattr(previous, "_lightning_ft_exits_zero", False):

        def exit_zero_when_finished(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
            if isinstance(value, JobAlreadyFinished):  # its line was logged where it was raised
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(0)
            previous(kind, value, traceback)

        exit_zero_when_finished._lightning_ft_exits_zero = True  # type: ignore[attr-defined]
        sys.excepthook = exit_zero_when_finished
    return JobAlreadyFinished(step, message)


class NoLivePeerError(LightningFTError, RuntimeError):
    """A restarted group found no live peer and the job keeps no checkpoint to resume from."""


@dataclass(frozen=True)
class StartDecision:
    """What the group does before its first quorum (picklable: it is broadcast inside the group)."""

    resume_from: Path | None = None
    # The lowest committed step the group's first quorum may have: the job's newest checkpoint or, for a restarted
    # group of a job that keeps none, the step the job's last quorum reached.
    floor_step: int | None = None
    floor_source: str = ""
    error: str | None = None
    missing_groups: tuple[int, ...] = field(default_factory=tuple)
    # A setting that differs between the groups of the job (raised as FTConfigError).
    config_error: str | None = None
    # A group of this run reported the run's end while this one waited: it exits 0 (JobAlreadyFinished).
    run_ended: GroupFinished | None = None


@dataclass
class StartContext:
    """What the decision depends on, gathered by the strategy."""

    group: int
    num_groups: int
    prefix: str
    lighthouse: str | None  # None: the embedded lighthouse of a one-group job (nobody to wait for)
    start_timeout_s: float
    attempt: int  # torchrun's restart count of this group
    record: JobRecord
    # The first report of this run's end by one of its groups, or None (lightning_ft_job.run_end); polled while waiting.
    run_ended: Callable[[], GroupFinished | None] = lambda: None
    # The highest committed step this run is remembered to have reached (lightning_ft_job.run_end.reached), 0 if none.
    run_reached: Callable[[], int] = lambda: 0


def finished_job(record: JobRecord, max_steps: int, max_epochs: int | None) -> FinishedJob | None:
    """The job's end, if it ended under the same limits; a record of an end under other limits is cleared."""
    finished = record.finished()
    if finished is None:
        return None
    if finished.applies_to(max_steps, max_epochs):
        return finished
    log.info(
        "lightning-ft: the job in %s finished at step %d under max_steps=%s, max_epochs=%s; it continues under "
        "max_steps=%s, max_epochs=%s",
        finished.directory,
        finished.step,
        finished.max_steps,
        finished.max_epochs,
        max_steps,
        max_epochs,
    )
    record.clear_finished()
    return None


def run_ended_message(report: GroupFinished, group: int) -> str:
    return (
        f"lightning-ft: replica group {group} exits without training: its run {report.run_id} already finished at "
        f"committed step {report.step} (replica group {report.group}: {report.reason}); nothing is left to train."
    )


def already_finished_message(finished: FinishedJob, group: int) -> str:
    return (
        f"lightning-ft: replica group {group} exits without training: the job whose checkpoints are in "
        f"{finished.directory} already finished at committed step {finished.step} ({finished.reason}). To train a "
        f"new model, use another ModelCheckpoint dirpath; to train this one further, raise max_steps/max_epochs."
    )


def decide_start(
    context: StartContext,
    read_status: Callable[[str], LighthouseStatus] = read_lighthouse_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> StartDecision:
    """Wait for a coherent start, then choose where to start from (see the module docstring)."""
    try:
        status, missing = _wait_for_groups(context, read_status, clock, sleep)
    except _GroupsDisagree as mismatch:
        return StartDecision(config_error=str(mismatch))
    except _RunEnded as ended:
        return StartDecision(run_ended=ended.report)
    live_peers = bool(status and status.fresh_groups(context.prefix) - {context.group})
    job_seen_before = context.attempt > 0 or bool(status and status.has_members_of(context.prefix))
    newest = context.record.newest()
    if newest is None:
        # (A job of one group has no peer to heal from: its restart starts over, as a torchrun restart would.)
        peers_expected = context.num_groups > 1 and context.lighthouse is not None
        if not context.record.exists and job_seen_before and peers_expected and status is not None:
            if live_peers:
                # The job's last quorum reached this step; a first quorum below it means the peers died meanwhile. The
                # run remembers it too: restarted groups that formed a quorum of their own at step 0 (every group was
                # down) made the lighthouse forget it.
                reached = max(max(status.previous_quorum.values(), default=0), context.run_reached())
                return StartDecision(
                    floor_step=reached or None, floor_source="the job's last quorum", missing_groups=missing
                )
            return StartDecision(
                missing_groups=missing,
                error=(
                    f"lightning-ft: replica group {context.group} restarted (attempt {context.attempt}) and found no "
                    f"live replica group within start_timeout={context.start_timeout_s:g}s, and the job keeps no "
                    f"checkpoint to resume from: training on alone would start the job over from this group's "
                    f"initial weights. Add a ModelCheckpoint with a fixed dirpath so that a group can resume the job "
                    f"from disk, or relaunch the whole job. (FTStrategy(start_timeout=...) sets how long to wait for "
                    f"a peer.)"
                ),
            )
        return StartDecision(missing_groups=missing)
    ahead = status.live_member_steps(context.prefix, context.group) if status else []
    source = f"the job's newest checkpoint, {newest.path}"
    if ahead and max(ahead) >= newest.step:
        return StartDecision(floor_step=newest.step, floor_source=source, missing_groups=missing)
    return StartDecision(resume_from=newest.path, floor_step=newest.step, floor_source=source, missing_groups=missing)


class _GroupsDisagree(Exception):
    """The groups of the job were given different ``num_replica_groups``."""


class _RunEnded(Exception):
    """A group of this run reported the run's end while this group waited."""

    def __init__(self, report: GroupFinished) -> None:
        super().__init__(report)
        self.report = report


def _num_groups_mismatch(context: StartContext, status: LighthouseStatus | None) -> str | None:
    """Why the job's groups cannot agree on ``num_replica_groups``, at the job's start: a group of this job heartbeats
    with an id this group counts outside the job. Each group shards the data by its id and ``num_replica_groups``,
    so groups that differ would read overlapping shards and skip others. (A job already under way is left alone: a
    group may join it later.)"""
    if status is None or status.live_member_steps(context.prefix, context.group):
        return None
    strangers = sorted(g for g in status.fresh_groups(context.prefix) if g >= context.num_groups)
    if not strangers:
        return None
    return (
        f"lightning-ft: replica group(s) {strangers} heartbeat to the lighthouse at {context.lighthouse} with this "
        f"job's replica id prefix {context.prefix!r}, but this group (replica_group_id={context.group}) was given "
        f"num_replica_groups={context.num_groups}, which has no such group. Every group of one job must be given the "
        f"same num_replica_groups and a distinct replica_group_id below it: set the environment variable "
        f"NUM_REPLICA_GROUPS or FTStrategy(num_replica_groups=...) alike in every group (lightning-ft launch "
        f"--replica-groups does). If another job shares this lighthouse, give it its own lighthouse or "
        f"FTStrategy(replica_id_prefix=...)."
    )


def _wait_for_groups(
    context: StartContext,
    read_status: Callable[[str], LighthouseStatus],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[LighthouseStatus | None, tuple[int, ...]]:
    """Wait until every group heartbeats, the job is under way, or ``start_timeout`` expires. Returns the last
    reading (None if the page cannot be read) and the groups still missing when the wait ended."""
    if context.lighthouse is None:
        return None, ()
    started = clock()
    everyone = set(range(context.num_groups))
    announced = False
    while True:
        ended = context.run_ended()
        if ended is not None:
            raise _RunEnded(ended)
        try:
            status = read_status(context.lighthouse)
        except StatusPageUnreadable as error:
            log.warning(
                "lightning-ft: cannot tell which replica groups are up (%s); starting without waiting for them", error
            )
            return None, ()
        mismatch = _num_groups_mismatch(context, status)
        if mismatch is not None:
            raise _GroupsDisagree(mismatch)
        present = status.fresh_groups(context.prefix) | {context.group}
        missing = tuple(sorted(everyone - present))
        under_way = bool(status.live_member_steps(context.prefix, context.group))
        if not missing or under_way:
            if announced:
                events.emit("groups_joined", waited_s=round(clock() - started, 3))
            return status, ()
        if clock() - started >= context.start_timeout_s:
            if context.start_timeout_s > 0:
                log.warning(
                    "lightning-ft: replica groups %s did not start within start_timeout=%gs; the job starts with "
                    "groups %s. The missing groups join and heal from a live peer when they start.",
                    list(missing),
                    context.start_timeout_s,
                    sorted(present),
                )
                events.emit("start_timeout_expired", missing=list(missing), waited_s=round(clock() - started, 3))
            return status, missing
        if not announced:
            announced = True
            log.info(
                "lightning-ft: waiting up to %gs for replica groups %s to start", context.start_timeout_s, list(missing)
            )
            events.emit("waiting_for_groups", missing=list(missing))
        sleep(POLL_INTERVAL_S)

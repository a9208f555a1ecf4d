"""The job's record through one fit of one replica group: exit after the job's end, start where the job is, save
only forward, take the last step with the job, record the end (the strategy calls these from its hooks; see
:mod:`.decision`, :mod:`.last_step` and :mod:`.record`).

Decisions are taken on group rank 0, which reads the record and the lighthouse, and broadcast inside the group, so
every rank of a group acts alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_ft import lightning_internals
from lightning_ft.loop_patches import LoopPatches
from lightning_ft.settings import FTConfigError, FTSettings
from lightning_ft.start.decision import (
    NoLivePeerError,
    StartContext,
    StartDecision,
    already_finished_message,
    decide_start,
    finished_job,
    job_already_finished,
    run_ended_message,
)
from lightning_ft.start.last_step import LastStepCheck
from lightning_ft.start.record import JobRecord, durable_checkpoint_dirs
from lightning_ft.step.protocol import StepProtocol
from lightning_ft_job import arrival, events, run_end
from lightning_ft_job.environment import torchrun_restart_count

log = logging.getLogger("lightning.pytorch.lightning_ft")


class GroupLifecycle:
    """One group's part in "one job, one model" for one fit.

    Args:
        trainer: The fitting trainer; its checkpoint directories hold the job's record.
        settings: The group's settings (id, job size, lighthouse, ``start_timeout``).
        group_rank: This process's rank in its group; rank 0 reads and writes the record.
        broadcast: The group's broadcast from rank 0 (``Strategy.broadcast``).
        run_id: The run this group belongs to, the same in every group and restart of the run
            (:func:`lightning_ft_job.events.run_id`, agreed on in the group): whose end it reports and heeds.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        settings: FTSettings,
        group_rank: int,
        broadcast: Callable[[Any], Any],
        run_id: str,
    ) -> None:
        # Only a run that a launcher can start again keeps a record: nobody would read a one-off fit's.
        restartable = events.given_run_id() is not None
        self.record = JobRecord(durable_checkpoint_dirs(trainer) if restartable else [], run_id)
        self._settings = settings
        self._group_rank = group_rank
        self._broadcast = broadcast
        self._run_id = run_id
        self._refused_a_save = False

    def _run_end_directory(self) -> Path | None:
        return run_end.configured_directory() or events.current_directory()

    def run_end_reports(self) -> dict[int, run_end.GroupFinished]:
        """This run's end reports, by group id."""
        return run_end.finished_groups(self._run_end_directory(), self._run_id)

    def run_ended(self) -> run_end.GroupFinished | None:
        """The first report of this run's end by one of its groups (the lowest group id), or None."""
        reports = self.run_end_reports()
        return reports[min(reports)] if reports else None

    def last_step_check(self, trainer: pl.Trainer) -> LastStepCheck:
        """The check before each vote that keeps the job's last step to one set of groups
        (:mod:`lightning_ft.start.last_step`)."""
        return LastStepCheck(trainer, self._settings, self._group_rank, self._broadcast, self.run_end_reports)

    def exit_if_job_finished(self, trainer: pl.Trainer) -> None:
        """A group started after its job finished exits 0 at once: no training, logging or checkpoint. Called before
        the group registers with the lighthouse. The job finished when a group of this run reported its end, or when
        the job's record says so under the same limits."""
        answer: tuple[int, str, str] | None = None
        if self._group_rank == 0:
            group = self._settings.replica_group_id
            ended = self.run_ended()
            finished = finished_job(self.record, trainer.max_steps, trainer.max_epochs) if self.record.exists else None
            if ended is not None:
                answer = (ended.step, run_ended_message(ended, group), "")
            elif finished is not None:
                answer = (finished.step, already_finished_message(finished, group), str(finished.directory))
        answer = self._broadcast(answer)
        if answer is not None:
            self._exit_finished(*answer)
        if self._group_rank == 0:
            for directory, other in self.record.other_runs().items():
                log.warning(
                    "lightning-ft: %s holds the checkpoints of run %s; this run (%s) trains the model it was given and "
                    "does not resume them. To continue that job instead, pass ckpt_path='last' to fit, or start "
                    "every group with LIGHTNING_FT_RUN_ID=%s.",
                    directory,
                    other,
                    self._run_id,
                    other,
                )

    def _exit_finished(self, step: int, message: str, directory: str) -> None:
        log.warning(message)
        events.emit("job_already_finished", step=step, directory=directory or None, run=self._run_id)
        raise job_already_finished(step, message)

    def start_where_the_job_is(self, trainer: pl.Trainer, protocol: StepProtocol, patches: LoopPatches) -> None:
        """Wait for a coherent start, then make sure this group never trains from a state older than the job's:
        resume from the newest checkpoint when no live peer is ahead of it, and check the first quorum's step."""
        decision = None
        if self._group_rank == 0:
            settings = self._settings
            # The Manager is up and heartbeats to the lighthouse: the launcher needs no warning about this group.
            arrival.report_arrived(self._run_id, settings.replica_group_id)
            decision = decide_start(
                StartContext(
                    group=settings.replica_group_id,
                    num_groups=settings.num_replica_groups,
                    prefix=settings.replica_id_prefix,
                    lighthouse=settings.lighthouse,
                    start_timeout_s=settings.start_timeout.total_seconds(),
                    attempt=torchrun_restart_count(),
                    record=self.record,
                    run_ended=self.run_ended,
                    run_reached=lambda: run_end.reached(self._run_end_directory(), self._run_id),
                )
            )
            directory = self._run_end_directory()
            if decision.floor_step and not self.record.exists and directory is not None:
                run_end.record_reached(directory, self._run_id, decision.floor_step)
        decision = self._broadcast(decision)
        assert isinstance(decision, StartDecision)
        if decision.run_ended is not None:
            self._exit_finished(
                decision.run_ended.step, run_ended_message(decision.run_ended, self._settings.replica_group_id), ""
            )
        if decision.config_error is not None:
            raise FTConfigError(decision.config_error)
        if decision.error is not None:
            events.emit("no_live_peer", error=decision.error)
            raise NoLivePeerError(decision.error)
        group = self._settings.replica_group_id

        def make(resume_start: Callable[..., None]) -> Callable[..., None]:
            def resume_where_the_job_is(
                checkpoint_path: lightning_internals.PathLike | None = None, **kwargs: Any
            ) -> None:
                if checkpoint_path:  # the user chose where the job resumes
                    return resume_start(checkpoint_path, **kwargs)
                protocol.require_floor(decision.floor_step, decision.floor_source)
                if decision.resume_from is not None:
                    log.warning(
                        "lightning-ft: no live replica group is ahead of the job's newest checkpoint; group %d "
                        "resumes the job from %s (committed step %d). Steps committed after it, if any, are lost.",
                        group,
                        decision.resume_from,
                        decision.floor_step,
                    )
                    events.emit("resumed_from_checkpoint", path=str(decision.resume_from), step=decision.floor_step)
                    checkpoint_path = decision.resume_from
                return resume_start(checkpoint_path, **kwargs)

            return resume_where_the_job_is

        patches.wrap(lightning_internals.checkpoint_connector(trainer), "resume_start", make)

    def refuses_save(self, filepath: lightning_internals.PathLike, step: int, is_writer: bool) -> bool:
        """Whether a save of a state at committed ``step`` must not be written, because the file's directory holds
        a newer one. The writer warns once and records the refusal."""
        refusal = self.record.refuse_save(filepath, step) if self._group_rank == 0 else None
        if self._broadcast(refusal) is None:
            return False
        if is_writer:  # the others would not have written it anyway
            if not self._refused_a_save:
                self._refused_a_save = True
                log.warning("lightning-ft: not writing %s: %s.", filepath, refusal)
            events.emit("checkpoint_refused", path=str(filepath), step=step)
        return True

    def record_the_end(self, trainer: pl.Trainer, committed_step: int) -> None:
        """A fit that ended normally ended the job: each group's rank 0 says so in the run's end report and the job's
        record, so that a group started after the end exits instead of waiting for its peers or training a new model,
        and the launcher counts this group as finished whatever its process does afterwards."""
        if self._group_rank != 0:
            return
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            reason = f"max_steps={trainer.max_steps} reached"
        elif (
            trainer.max_epochs is not None and trainer.max_epochs != -1 and trainer.current_epoch >= trainer.max_epochs
        ):
            reason = f"max_epochs={trainer.max_epochs} reached"
        elif trainer.should_stop:
            reason = "stopped early"
        else:
            return
        directory = self._run_end_directory()
        if directory is not None:
            report = run_end.GroupFinished(self._run_id, self._settings.replica_group_id, committed_step, reason)
            run_end.report_finished(directory, report)
        if not self.record.exists:
            return
        self.record.mark_finished(
            step=committed_step,
            epoch=trainer.current_epoch,
            max_steps=trainer.max_steps,
            max_epochs=trainer.max_epochs,
            reason=reason,
        )

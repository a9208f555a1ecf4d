"""The launcher's view of the job, computed from every group's state on every poll: running, finished or failed.

One rule, whichever group is where: the job has **finished** as soon as one group finished it (its rank 0 reported
the run's end, :mod:`lightning_ft_job.run_end`, or its torchrun job exited 0). From then on

* a group whose process exits after it reported its end has finished, whatever its exit code (logged once);
* groups still running ``finish_grace`` seconds after the job finished are stopped, on purpose (a group restarted
  after the end exits by itself when it can read the run's end; this is the backstop when it cannot).

A group that exits with an error without having reported its end has used up its restarts: it failed, before or after
the end (a group restarted after the end exits 0, so an error is its own), and the launcher exits 1 once everything
has stopped. Nothing here depends on the order in which processes exit: every poll
reads every group's exit code and every report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field


@dataclass
class JobState:
    """What the launcher knows of the job; :meth:`observe` takes one poll of every group.

    Args:
        group_ids: The groups this launcher started.
        finish_grace: Seconds after the job finished before groups still running are stopped.
        clock: Monotonic seconds.
    """

    group_ids: tuple[int, ...]
    finish_grace: float
    clock: Callable[[], float]
    finished_at: float | None = None  # when the job finished (the first report or exit 0 seen)
    finished_by: int | None = None  # the group that finished it first
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)  # groups whose rank 0 reported the run's end
    failed: set[int] = field(default_factory=set)  # exited with an error without having finished
    _explained: set[int] = field(default_factory=set)

    def observe(self, exit_codes: Mapping[int, int | None], reported: Set[int]) -> list[str]:
        """Take one poll (each group's exit code, None while it runs, and the groups that reported the run's end);
        return the lines to print about it, each said once."""
        self.exit_codes = dict(exit_codes)
        self.reported |= set(reported)
        lines: list[str] = []
        # A failure is never hidden, before or after the end: a group restarted after the end reads the run's end and
        # exits 0, so one that exits with an error failed on its own (a model other groups refused, say).
        for group in self.group_ids:
            code = self.exit_codes.get(group)
            if code in (None, 0) or group in self._explained or group in self.failed:
                continue
            if group in self.reported:
                self._explained.add(group)
                lines.append(
                    f"replica group {group} exited with code {code} after it had finished; it counts as finished"
                )
            else:
                self.failed.add(group)
                lines.append(f"replica group {group} failed (exit code {code}) and will not be restarted")
        if self.finished_at is None:
            first = sorted(self.reported) or [g for g in self.group_ids if self.exit_codes.get(g) == 0]
            if first:
                self.finished_at = self.clock()
                self.finished_by = first[0]
                still = [g for g in self.running if g not in self.reported]
                if still:
                    lines.append(
                        f"the job finished (replica group {self.finished_by} reached its end); replica groups "
                        f"{still} are still running and are stopped if they have not ended in {self.finish_grace:g}s"
                    )
        return lines

    @property
    def running(self) -> list[int]:
        return [group for group in self.group_ids if self.exit_codes.get(group) is None]

    def grace_expired(self) -> bool:
        """Whether the job finished more than ``finish_grace`` seconds ago."""
        return self.finished_at is not None and self.clock() - self.finished_at > self.finish_grace

    def done(self) -> bool:
        """Nothing left to wait for: every group has exited, or the job finished and its grace has expired."""
        return not self.running or self.grace_expired()


@dataclass
class ArrivalWatch:
    """Which groups have not reached the lighthouse (:mod:`lightning_ft_job.arrival`): one warning each.

    A group that has not said it arrived ``warn_after`` seconds into the job, or that exits 0 without having said
    so, most likely runs a Trainer without FTStrategy: it trains alone, on the same data as every other group. A
    group that fails has its own message (:class:`JobState`), so none here.

    Args:
        group_ids: The groups this launcher started.
        warn_after: Seconds from the launch.
        clock: Monotonic seconds.
    """

    group_ids: tuple[int, ...]
    warn_after: float
    clock: Callable[[], float]
    started_at: float = field(init=False)
    _warned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    def observe(self, exit_codes: Mapping[int, int | None], arrived: Set[int]) -> list[str]:
        """Take one poll (each group's exit code, None while it runs, and the groups that arrived); return the
        warnings to print, each group at most once."""
        late = self.clock() - self.started_at >= self.warn_after
        lines = []
        for group in self.group_ids:
            if group in arrived or group in self._warned:
                continue
            code = exit_codes.get(group)
            if code == 0 or (code is None and late):
                self._warned.add(group)
                when = "exited 0" if code == 0 else f"has run {self.warn_after:g}s"
                lines.append(
                    f"warning: replica group {group} {when} without reaching the lighthouse: most likely its "
                    f'Trainer has no FTStrategy (strategy="ft" after `import lightning_ft`), so it trains alone, on '
                    f"the same data as the other groups (docs/quickstart.md)"
                )
        return lines

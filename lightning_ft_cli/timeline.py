"""A run's event logs as one timeline per replica group, for ``lightning-ft report`` (no plotting here).

Each group is read from its rank 0's log: the ranks of a group share every quorum, vote and heal, so the other ranks
would only repeat them. What a group did becomes *points* (one per vote: the step, whether it committed, the
participants, the loss) and *marks* (heals and failures). A failure is an uncommitted step, a step every replica
skipped for a non-finite gradient, or the death of a process: an ``exception`` event, or a process of the group that
stopped without finishing and was followed by another one (a restart; a SIGKILLed process leaves no word of its
own).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ft_job.events import DEFAULT_SUBDIR, FILE_PATTERN, read_events


@dataclass(frozen=True)
class Point:
    """One vote of a group: after it, the committed step count was ``step``. ``pid``: the process that voted."""

    time: float
    step: int
    committed: bool
    participants: int
    loss: float | None
    pid: int


@dataclass(frozen=True)
class Mark:
    """A heal or a failure. ``kind``: ``heal``, ``uncommitted``, ``skipped`` or ``died``."""

    time: float
    step: int
    kind: str
    detail: str = ""


@dataclass
class GroupTimeline:
    group: int
    points: list[Point] = field(default_factory=list)
    heals: list[Mark] = field(default_factory=list)
    failures: list[Mark] = field(default_factory=list)
    processes: int = 0  # how many processes (restart attempts) rank 0 of the group ran

    def segments(self) -> list[list[Point]]:
        """The committed votes of each process in turn: a line per process, with a gap while the group was down."""
        runs: dict[int, list[Point]] = {}
        for point in self.points:
            if point.committed:
                runs.setdefault(point.pid, []).append(point)
        return list(runs.values())

    def participants_at(self, time: float) -> int:
        """Participants of this group's latest vote at or before ``time`` (0 before its first)."""
        value = 0
        for point in self.points:
            if point.time > time:
                break
            value = point.participants
        return value


@dataclass
class Timeline:
    sources: list[Path]
    groups: dict[int, GroupTimeline]
    start: float  # the earliest event, the origin of the time axis
    num_replica_groups: int

    @property
    def committed_steps(self) -> int:
        return max((p.step for g in self.groups.values() for p in g.points if p.committed), default=0)


class NoEventLogError(FileNotFoundError):
    """No event log under the given directory."""


def find_event_files(run_dir: str | Path) -> list[Path]:
    """The event files of a run: every ``group*.rank*.jsonl`` under ``run_dir``, at any depth. When there is none
    (``run_dir`` is a logger's version directory, below the run's root), the ``ft_events`` directory of the nearest
    ancestor that has one."""
    root = Path(run_dir)
    if not root.is_dir():
        raise NoEventLogError(f"{root} is not a directory")
    files = sorted(root.rglob(FILE_PATTERN))
    if files:
        return files
    for ancestor in root.resolve().parents:
        files = sorted((ancestor / DEFAULT_SUBDIR).glob(FILE_PATTERN))
        if files:
            return files
    raise NoEventLogError(
        f"no event log ({DEFAULT_SUBDIR}/{FILE_PATTERN}) under {root} or next to any of its parents. FTStrategy writes "
        f"it under the Trainer's default_root_dir, or where LIGHTNING_FT_EVENTS_DIR points."
    )


def load_timeline(run_dir: str | Path) -> Timeline:
    """Read a run's event logs (see :func:`find_event_files`) into one timeline per replica group."""
    files = find_event_files(run_dir)
    records = [r for directory in sorted({f.parent for f in files}) for r in read_events(directory)]  # sorted below
    records = [r for r in records if r.get("rank") == 0 and "group" in r]
    if not records:
        raise NoEventLogError(f"the event logs in {sorted({str(f.parent) for f in files})} have no rank-0 events")
    records.sort(key=lambda r: r["time"])
    by_group: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_group[int(record["group"])].append(record)
    groups = {group: _group_timeline(group, group_records) for group, group_records in sorted(by_group.items())}
    _place_on_steps(groups)
    declared = [int(r["replica_groups"]) for r in records if r["event"] == "started" and "replica_groups" in r]
    num_groups = max([*declared, max(groups) + 1])
    sources = sorted({f.parent for f in files})
    return Timeline(sources=sources, groups=groups, start=records[0]["time"], num_replica_groups=num_groups)


def _group_timeline(group: int, records: list[dict[str, Any]]) -> GroupTimeline:
    timeline = GroupTimeline(group)
    rejected = {(r["pid"], r.get("step")) for r in records if r["event"] == "step_rejected"}
    for record in records:
        event, time = record["event"], float(record["time"])
        if event == "step":
            step, committed = int(record["step"]), bool(record.get("committed"))
            loss = record.get("loss")
            participants = int(record.get("participants", 0))
            timeline.points.append(Point(time, step, committed, participants, loss, int(record["pid"])))
            if not committed and (record["pid"], step) not in rejected:
                timeline.failures.append(Mark(time, step, "uncommitted", record.get("error", "")))
        elif event == "step_rejected":
            timeline.failures.append(Mark(time, int(record["step"]), "skipped", record.get("reason", "")))
        elif event == "healed":
            seconds = record.get("seconds")
            detail = f"{seconds:.2f} s" if isinstance(seconds, (int, float)) else ""
            timeline.heals.append(Mark(time, int(record["step"]), "heal", detail))
    timeline.failures.extend(_deaths(records))
    timeline.failures.sort(key=lambda mark: mark.time)
    timeline.processes = len({r["pid"] for r in records if r["event"] == "started"})
    return timeline


def _deaths(records: list[dict[str, Any]]) -> list[Mark]:
    """Processes of one group that died: an ``exception`` event, or no ``finished`` and a successor process."""
    pids: list[int] = []
    for record in records:
        if record["pid"] not in pids:
            pids.append(record["pid"])
    deaths = []
    for index, pid in enumerate(pids):
        own = [r for r in records if r["pid"] == pid]
        exception = next((r for r in own if r["event"] == "exception"), None)
        finished = any(r["event"] == "finished" for r in own)
        if exception is None and (finished or index == len(pids) - 1):
            continue
        last = exception or own[-1]
        detail = f"{exception['type']}: {exception['message']}" if exception else "stopped without a word (killed?)"
        deaths.append(Mark(float(last["time"]), -1, "died", detail))  # its step: see _place_on_steps
    return deaths


def _place_on_steps(groups: dict[int, GroupTimeline]) -> None:
    """Put each death at the job's committed step at that moment (the highest any group had reached): the dying
    process's own count may be stale (a restarted process counts 0 until it heals)."""
    points = sorted((p for g in groups.values() for p in g.points if p.committed), key=lambda p: p.time)
    for timeline in groups.values():
        placed = []
        for mark in timeline.failures:
            if mark.step < 0:
                step = max((p.step for p in points if p.time <= mark.time), default=0)
                mark = Mark(mark.time, step, mark.kind, mark.detail)
            placed.append(mark)
        timeline.failures = placed

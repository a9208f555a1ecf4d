"""A run's event logs as one timeline per replica group, for ``lightning-ft report`` (no plotting here).

Each group is read from its rank 0's log: the ranks of a group share every quorum, vote and heal, so the other ranks
would only repeat them. What a group did becomes *points* (one per vote: the step, whether it committed, the
participants, the loss) and *marks* (heals and failures). A failure is an uncommitted step, a step every replica
skipped for a non-finite gradient, or the death of a process: an ``exception`` event, or a process of the group that
stopped without finishing and was followed by another one (a restart; a SIGKILLed process leaves no word of its
own).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ft_job.events import DEFAULT_SUBDIR, FILE_PATTERN, RUN_POINTER, read_events


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
    """A heal or a failure. ``kind``: ``heal``, ``uncommitted``, ``skipped``, ``died`` or ``stalled`` (training resumed
    after a lighthouse outage; ``detail`` says how long it stalled)."""

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
    other_runs: list[str] = field(default_factory=list)  # runs found beside the one drawn (``--run`` picks one)
    run: str = ""  # the run's id, as its groups logged it (else its event directory's name)

    @property
    def name(self) -> str:
        """How the report names the run (its title): by its id."""
        return f"run {self.run}"

    @property
    def committed_steps(self) -> int:
        return max((p.step for g in self.groups.values() for p in g.points if p.committed), default=0)


class NoEventLogError(FileNotFoundError):
    """No event log under the given directory, or not the run asked for."""


@dataclass(frozen=True)
class FoundRun:
    """The event directory of the run to draw, and every run found beside it (for the report to name)."""

    directory: Path
    runs: list[Path]


def _has_events(directory: Path) -> bool:
    return directory.is_dir() and any(directory.glob(FILE_PATTERN))


def _runs_of_events_root(events_root: Path) -> list[Path]:
    """The runs under an ``ft_events`` directory: each subdirectory with event files (one per run), and the directory
    itself if it holds files of its own (the layout before per-run directories)."""
    if not events_root.is_dir():
        return []
    runs = [events_root] if _has_events(events_root) else []
    return runs + sorted(d for d in events_root.iterdir() if _has_events(d))


def _runs_below(root: Path) -> list[Path]:
    """The runs in or just below ``root``: ``root`` itself when it holds event files (a run's directory,
    ``launch --events-dir``); else its subdirectories that do, and the runs of its ``ft_events``."""
    if _has_events(root):
        return [root]
    runs = [d for d in sorted(root.iterdir()) if d.is_dir() and d.name != DEFAULT_SUBDIR and _has_events(d)]
    return runs + _runs_of_events_root(root / DEFAULT_SUBDIR)


def _pointed_run(place: Path) -> Path | None:
    """The run a logger's log directory points at (:data:`lightning_ft_job.events.RUN_POINTER`), if it does."""
    pointer = place / RUN_POINTER
    if not pointer.is_file():
        return None
    try:
        record = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return None
    candidates = [place / record["relative"]] if record.get("relative") else []
    candidates += [Path(record["events_dir"])] if record.get("events_dir") else []
    return next((candidate.resolve() for candidate in candidates if _has_events(candidate)), None)


def _newest(runs: list[Path]) -> Path:
    return max(runs, key=lambda run: max(f.stat().st_mtime for f in run.glob(FILE_PATTERN)))


def find_run(run_dir: str | Path, run: str | None = None) -> FoundRun:
    """The one run to draw for ``run_dir``, never several mixed:

    * a logger's log directory (or a directory below it, such as its checkpoints) names its run, through the pointer
      the run left there;
    * an events directory is its own run;
    * the Trainer's ``default_root_dir`` (or its checkpoint directory, below it) holds one run per directory of its
      ``ft_events``: the newest is drawn, or the one named ``run``.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise NoEventLogError(f"{root} is not a directory")
    for depth, place in enumerate([root, *root.resolve().parents]):
        pointed = None if run is not None else _pointed_run(place)
        if pointed is not None:
            return FoundRun(pointed, [pointed])
        runs = _runs_below(place) if depth == 0 else _runs_of_events_root(place / DEFAULT_SUBDIR)
        if not runs:
            continue
        if run is None:
            return FoundRun(_newest(runs), runs)
        named = [candidate for candidate in runs if candidate.name == run]
        if not named:
            names = ", ".join(candidate.name for candidate in runs)
            raise NoEventLogError(f"no run named {run!r} in {place}; its runs: {names}")
        return FoundRun(named[0], runs)
    raise NoEventLogError(
        f"no event log ({DEFAULT_SUBDIR}/<run>/{FILE_PATTERN}) in or below {root}, nor in the {DEFAULT_SUBDIR} of any "
        f"of its parents. FTStrategy writes it under the Trainer's default_root_dir, or where LIGHTNING_FT_EVENTS_DIR "
        f"points."
    )


def find_event_files(run_dir: str | Path, run: str | None = None) -> list[Path]:
    """The event files of the run :func:`find_run` picks."""
    return sorted(find_run(run_dir, run).directory.glob(FILE_PATTERN))


def load_timeline(run_dir: str | Path, run: str | None = None) -> Timeline:
    """Read one run's event logs (see :func:`find_run`) into one timeline per replica group."""
    found = find_run(run_dir, run)
    records = read_events(found.directory)  # sorted below
    records = [r for r in records if r.get("rank") == 0 and "group" in r]
    if not records:
        raise NoEventLogError(f"the event log in {found.directory} has no rank-0 events")
    records.sort(key=lambda r: r["time"])
    by_group: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_group[int(record["group"])].append(record)
    groups = {group: _group_timeline(group, group_records) for group, group_records in sorted(by_group.items())}
    _place_on_steps(groups)
    declared = [int(r["replica_groups"]) for r in records if r["event"] == "started" and "replica_groups" in r]
    num_groups = max([*declared, max(groups) + 1])
    run_ids = [str(r["run"]) for r in records if r["event"] == "started" and r.get("run")]
    return Timeline(
        run=run_ids[0] if run_ids else found.directory.name,
        sources=[found.directory.resolve()],
        groups=groups,
        start=records[0]["time"],
        num_replica_groups=num_groups,
        other_runs=[candidate.name for candidate in found.runs if candidate != found.directory],
    )


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
        elif event == "lighthouse_back":
            stalled = record.get("stalled_s")
            detail = f"lighthouse outage, {stalled:.1f} s" if isinstance(stalled, (int, float)) else "lighthouse outage"
            timeline.failures.append(Mark(time, int(record.get("step") or 0), "stalled", detail))
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

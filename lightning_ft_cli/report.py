"""``lightning-ft report RUN_DIR -o timeline.png``: draw a run's fault-tolerance timeline from its event logs.

Three panels, one colour per replica group: participants over committed steps, participants over wall-clock time
(with the heals and failures marked on both), and the training loss over committed steps. The events are read by
:mod:`lightning_ft_cli.timeline`; this module only draws. matplotlib is imported when a picture is drawn, not before:
it is an optional dependency (the ``report`` extra), and the rest of the command line must work
without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lightning_ft_cli.timeline import GroupTimeline, Mark, NoEventLogError, Timeline, load_timeline

INSTALL_HINT = "pip install matplotlib (the report extra: pip install '.[report]' in a clone of lightning-ft)"

# marker, face colour ("group": the group's colour, "none": hollow), label
MARKS = {
    "heal": ("^", "group", "heal"),
    "uncommitted": ("o", "none", "uncommitted step"),
    "skipped": ("s", "none", "skipped step (non-finite gradient)"),
    "died": ("X", "group", "process died"),
    "stalled": ("D", "none", "resumed after a lighthouse outage"),
}


class MissingMatplotlibError(RuntimeError):
    """matplotlib, an optional dependency, is not installed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        help="a logger's log directory (draws that run), an events directory (launch --events-dir), or the Trainer's "
        "default_root_dir or its checkpoint directory (draws the newest run of its ft_events, or --run)",
    )
    parser.add_argument("-o", "--output", default="timeline.png", help="PNG file to write (default: %(default)s)")
    parser.add_argument("--run", default=None, help="the run to draw, by its directory's name under ft_events")


def run(args: argparse.Namespace) -> int:
    try:
        timeline = load_timeline(args.run_dir, getattr(args, "run", None))
    except NoEventLogError as error:
        print(f"lightning-ft report: {error}", file=sys.stderr)
        return 2
    try:
        render(timeline, Path(args.output), title=timeline.name)
    except MissingMatplotlibError as error:
        print(f"lightning-ft report: {error}", file=sys.stderr)
        return 2
    print(summary(timeline))
    print(f"lightning-ft report: wrote {args.output}")
    return 0


def summary(timeline: Timeline) -> str:
    """A few lines per group: what the picture shows, for a terminal or a CI log."""
    lines = [f"event logs: {', '.join(str(source) for source in timeline.sources)}"]
    if timeline.other_runs:
        lines.append(
            f"({len(timeline.other_runs) + 1} runs there; --run NAME draws another: {', '.join(timeline.other_runs)})"
        )
    for group, data in timeline.groups.items():
        committed = [p for p in data.points if p.committed]
        recoveries, initial_syncs = split_heals(data.heals)
        heals = ", ".join(f"step {h.step}" + (f" ({h.detail})" if h.detail else "") for h in recoveries) or "none"
        if initial_syncs:
            heals += f"; {_plural(len(initial_syncs), 'initial sync')} from a peer"
        failures = {kind: sum(f.kind == kind for f in data.failures) for kind in ("uncommitted", "skipped", "died")}
        stalls = [f"step {f.step} ({f.detail})" for f in data.failures if f.kind == "stalled"]
        lines.append(
            f"group {group}: {len(committed)} committed steps (up to {max((p.step for p in committed), default=0)}), "
            f"{failures['uncommitted']} uncommitted, {failures['skipped']} skipped, {failures['died']} process "
            f"deaths, {data.processes} process(es); heals: {heals}"
            + (f"; stalls: {', '.join(stalls)}" if stalls else "")
        )
    return "\n".join(lines)


def headline(timeline: Timeline) -> str:
    """The picture's title line: the job in counts. Deaths and uncommitted steps are counted apart (one death
    usually costs its survivors an uncommitted step too), and a heal at step 0 is the initial sync of a group that
    started after another, not a recovery."""
    marks = [m for g in timeline.groups.values() for m in g.failures]
    count = {kind: sum(m.kind == kind for m in marks) for kind in ("died", "uncommitted", "skipped")}
    recoveries, initial_syncs = split_heals([m for g in timeline.groups.values() for m in g.heals])
    parts = [
        f"{timeline.num_replica_groups} replica groups",
        _plural(timeline.committed_steps, "committed step"),
        _plural(count["died"], "process death"),
        _plural(count["uncommitted"], "uncommitted step"),
    ]
    if count["skipped"]:
        parts.append(_plural(count["skipped"], "skipped step"))
    parts.append(_plural(len(recoveries), "heal"))
    if initial_syncs:
        parts.append(_plural(len(initial_syncs), "initial sync"))
    return ", ".join(parts)


def split_heals(heals: list[Mark]) -> tuple[list[Mark], list[Mark]]:
    """A group's heals as the report counts them, in words and picture alike: recoveries (after step 0), and
    initial syncs (a heal at step 0: a group that started after another took its initial state, not a recovery)."""
    return [h for h in heals if h.step > 0], [h for h in heals if h.step <= 0]


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _matplotlib_figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        raise MissingMatplotlibError(
            f"drawing the timeline needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from error
    return Figure


def render(timeline: Timeline, output: Path, title: str = "") -> None:
    """Draw the timeline into a PNG at ``output``. A ``Figure`` without pyplot: no GUI backend, no global state."""
    figure_class = _matplotlib_figure()
    figure = figure_class(figsize=(11, 11), layout="constrained")
    by_step, by_time, loss = figure.subplots(3, 1)
    count = len(timeline.groups)
    for index, (group, data) in enumerate(timeline.groups.items()):
        colour = f"C{group % 10}"
        # Every group sees the same participants, so their lines overlap: earlier groups are drawn wider underneath.
        width = 1.5 + 3.0 * (count - 1 - index) / max(1, count - 1)
        # "pre": a vote's participants held since the previous vote. A line per process: a gap while the group was down.
        for number, segment in enumerate(data.segments()):
            label = f"group {group}" if number == 0 else None
            style = {"where": "pre", "color": colour, "linewidth": width, "alpha": 0.75, "label": label}
            participants = [p.participants for p in segment]
            by_step.step([p.step for p in segment], participants, **style)
            by_time.step([p.time - timeline.start for p in segment], participants, **style)
        _draw_marks(by_step, by_time, data, colour, timeline.start)
        labelled = False
        for segment in data.segments():
            losses = [p for p in segment if p.loss is not None]
            if losses:
                label = None if labelled else f"group {group}"
                loss.plot([p.step for p in losses], [p.loss for p in losses], color=colour, linewidth=1, label=label)
                labelled = True
    top = timeline.num_replica_groups
    for axes, xlabel in ((by_step, "committed step"), (by_time, "seconds since the run's first event")):
        axes.set_ylim(-0.3, top + 0.5)
        axes.set_yticks(range(top + 1))
        axes.set_ylabel(f"participants (of {top})")
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
    by_time.set_xlim(left=0)
    _legend(by_step)
    by_step.set_title("replica groups in each step's quorum, with heals and failures")
    by_time.set_title("the same over wall-clock time")
    loss.set_title("training loss")
    loss.set_xlabel("committed step")
    loss.set_ylabel("loss")
    loss.grid(alpha=0.3)
    if loss.lines:
        loss.legend(loc="upper right", fontsize="small")
    else:
        loss.text(0.5, 0.5, "no loss in the event log", transform=loss.transAxes, ha="center", va="center")
    counts = headline(timeline)
    figure.suptitle(f"{title}\n{counts}" if title else counts)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)


def _draw_marks(by_step: Any, by_time: Any, data: GroupTimeline, colour: str, start: float) -> None:
    for mark in [*data.heals, *data.failures]:
        marker, face, _ = MARKS[mark.kind]
        y = _height(data, mark)
        style = {
            "marker": marker,
            "markersize": 10,
            "markeredgecolor": colour,
            "markerfacecolor": colour if face == "group" else "none",
            "markeredgewidth": 1.5,
            "linestyle": "none",
            "zorder": 3,
        }
        by_step.plot([mark.step], [y], **style)
        by_time.plot([mark.time - start], [y], **style)


def _height(data: GroupTimeline, mark: Mark) -> int:
    """A heal sits on the quorum the group healed into (its next vote), anything else on the latest one before it."""
    if mark.kind == "heal":
        following = next((p.participants for p in data.points if p.time >= mark.time), None)
        if following is not None:
            return following
    return data.participants_at(mark.time)


def _legend(axes: Any) -> None:
    """The groups' lines, then one grey entry per kind of mark."""
    handles, labels = axes.get_legend_handles_labels()
    groups = [(h, label) for h, label in zip(handles, labels, strict=True) if label.startswith("group")]
    kinds = []
    for marker, face, label in MARKS.values():
        (handle,) = axes.plot(
            [], [], marker=marker, linestyle="none", color="grey", markerfacecolor="grey" if face == "group" else "none"
        )
        kinds.append((handle, label))
    entries = groups + kinds
    axes.legend([h for h, _ in entries], [label for _, label in entries], loc="lower left", fontsize="small", ncol=2)

"""A soak: many SIGKILLs drawn like the random fault schedules, on jobs of many replica groups, every path, with the
schedules' invariants checked at the end of every job.

Each job is a :class:`FaultSchedule` of ``tests/support/fault_schedules.py`` with more groups (6 by default, one process
each) and many kills: one every ``--spacing`` committed steps, each of a random group (now and then the same group
again, right after it rejoins) at a random point of its step (batch start, quorum, allreduce), the last one now and then
in the job's last steps. The schedule's own executor carries the kills out (never every group at once) and
:func:`check_invariants` checks the job: it ended by itself with exit 0, one model at exactly ``max_steps`` in every
group that reports, a group without a final state came back after the end and said so, nobody waited for peers that
were gone. The paths take turns, one job each, until ``--kills`` SIGKILLs were carried out. A kill that finds the job
already over is not counted.

Figures per job: kills carried out, committed steps (the Manager step the final states hold), the longest time a live
process waited between two of its commits (the survivors' longest wait), and the verdict. A failed job's folder is
kept (its path is in the results file), and so is the folder of a job whose longest wait exceeds ``--keep-waits-over``
seconds (30 by default), to read why in its event log. Each run writes a new file,
``benchmarks/results/soak/<UTC>_<commit>[_<label>].json``. Usage::

    python -m benchmarks.soak.soak --kills 1000                  # about an hour and a half on 2 cores
    python -m benchmarks.soak.soak --kills 20 --paths ddp --label smoke
    python -m benchmarks.soak.soak --report benchmarks/results/soak/*.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.process_harness import (
    FAULT_SCHEDULE_PATHS,
    POINTS,
    FaultSchedule,
    Kill,
    LaunchedJob,
    carry_out,
    check_invariants,
    launch_job,
)
from benchmarks.common.results import header, new_results_file

SYNC_EVERY = 4  # the semi-sync paths' --sync-every (tests/support/fault_schedules.py)
TAIL_STEPS = 8  # steps after the last kill's step: the last kills land near the job's end, not after it
FAILED_JOBS = Path(tempfile.gettempdir()) / "lightning-ft-soak-failures"


def draw(rng: random.Random, seed: int, path: str, groups: int, kills: int, spacing: int) -> FaultSchedule:
    """One job's schedule: ``kills`` kills ``spacing`` steps apart, drawn from ``rng`` alone."""
    drawn: list[Kill] = []
    for index in range(kills):
        step = 3 + spacing * index
        previous = drawn[-1] if drawn else None
        if previous is not None and rng.random() < 0.2:  # the same group again, right after it rejoins
            group, step = previous.group, previous.step + 1
        else:
            group = rng.randrange(groups)
        drawn.append(Kill(group, 0, max(step, previous.step if previous else 0), rng.choice(POINTS)))
    # A multiple of the semi-sync paths' sync period (4): their last inner steps are synced only when the job ends on a
    # sync step (FTStrategy warns otherwise), and the invariants compare the final models.
    max_steps = -(-(drawn[-1].step + TAIL_STEPS) // SYNC_EVERY) * SYNC_EVERY
    if rng.random() < 0.5:  # the last kill in the job's last steps
        last = drawn[-1]
        drawn[-1] = Kill(last.group, 0, max_steps - 1 - rng.randrange(3), last.point)
    return FaultSchedule(seed, groups, 1, path, max_steps, tuple(drawn))


def longest_wait(job: LaunchedJob) -> float:
    """The longest time any process waited between two of its own commits (a survivor's stall; a killed process's
    last wait ends with it and is not counted)."""
    by_pid: dict[int, list[float]] = {}
    for event in job.events("step", committed=True):
        by_pid.setdefault(event["pid"], []).append(event["time"])
    gaps = (b - a for times in by_pid.values() for a, b in itertools.pairwise(sorted(times)))
    return round(max(gaps, default=0.0), 3)


def soak_job(root: Path, schedule: FaultSchedule, keep_waits_over_s: float = 30.0) -> dict[str, Any]:
    """Run one schedule on a real job and check its invariants; the job's figures and verdict. The job's folder is
    kept when it failed, or when a live process waited more than ``keep_waits_over_s`` between two commits (to read
    why in its event log)."""
    job = launch_job(
        root,
        groups=schedule.groups,
        max_restarts=schedule.max_restarts,
        worker_args=[*schedule.worker_args, "--gate-dir={root}"],
        launcher_args=schedule.launcher_args,
    )
    said: list[str] = []
    started = time.monotonic()
    failure = None
    try:
        job.wait_for("every Manager to start", lambda: all(job.worker_pid(g, 0) for g in range(schedule.groups)))
        (job.root / "go").touch()
        carry_out(job, schedule, said)
        check_invariants(job, schedule)
    except AssertionError as error:
        failure = str(error)[-4000:]
    finally:
        job.stop()
    states = job.final_states()
    record = {
        "schedule": schedule.describe(),
        "seed": schedule.seed,
        "path": schedule.path,
        "groups": schedule.groups,
        "max_steps": schedule.max_steps,
        "kills_drawn": len(schedule.kills),
        "kills": sum("killed pid" in line for line in said),
        "committed_steps": max((int(s.get("manager_step", 0)) for s in states.values()), default=0),
        "final_states": len(states),
        "restarts_after_the_end": len(job.events("job_already_finished")),
        "longest_wait_s": longest_wait(job),
        "seconds": round(time.monotonic() - started, 1),
        "ok": failure is None,
        "failure": failure,
        "said": said,
    }
    if failure is not None or record["longest_wait_s"] > keep_waits_over_s:
        kept = FAILED_JOBS / f"{root.parent.name}-{root.name}"
        shutil.copytree(root, kept, dirs_exist_ok=True)
        record["kept"] = str(kept)
    return record


def save(out: Path, args: argparse.Namespace, records: list[dict[str, Any]], complete: bool) -> None:
    """Write the run's file after every job: a soak stopped early keeps the jobs it ran (``complete`` false)."""
    settings = {k: getattr(args, k) for k in ("kills", "groups", "kills_per_job", "spacing", "paths", "seed")}
    result = {**header(), "settings": settings, "complete": complete, **summary(records), "jobs": records}
    out.write_text(json.dumps(result, indent=1))


def run(args: argparse.Namespace, scratch: Path, out: Path) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    records: list[dict[str, Any]] = []
    for number, path in enumerate(itertools.cycle(args.paths)):
        carried = sum(r["kills"] for r in records)
        if carried >= args.kills:
            break
        kills = min(args.kills_per_job, args.kills - carried)
        schedule = draw(rng, args.seed * 100_000 + number, path, args.groups, kills, args.spacing)
        record = soak_job(scratch / f"job{number}", schedule, args.keep_waits_over)
        records.append(record)
        verdict = "ok" if record["ok"] else "FAILED"
        verdict += f" (kept in {record['kept']})" if "kept" in record else ""
        print(
            f"job {number} ({path}): {record['kills']} kills, {record['committed_steps']} committed steps, "
            f"longest wait {record['longest_wait_s']} s, {record['seconds']} s: {verdict}; "
            f"{carried + record['kills']} kills so far",
            flush=True,
        )
        if not record["ok"]:
            print(record["failure"], flush=True)
        save(out, args, records, complete=False)
    return records


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "jobs_run": len(records),  # not "jobs": the results file keeps the job records under that key
        "kills": sum(r["kills"] for r in records),
        "committed_steps": sum(r["committed_steps"] for r in records),
        "longest_wait_s": max((r["longest_wait_s"] for r in records), default=0.0),
        "failed_jobs": sum(not r["ok"] for r in records),
        "hangs": sum(bool(r["failure"]) and "backstop" in r["failure"] for r in records),
        "restarts_after_the_end": sum(r["restarts_after_the_end"] for r in records),
        "hours": round(sum(r["seconds"] for r in records) / 3600, 2),
    }


def report(paths: list[Path]) -> None:
    """A markdown table of kept runs: per path, the jobs, kills, committed steps, longest wait and failures."""
    print("| run | path | jobs | kills | committed steps | longest wait | failed jobs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for file in paths:
        records = json.loads(file.read_text())["jobs"]
        for path in sorted({r["path"] for r in records}):
            mine = [r for r in records if r["path"] == path]
            total = summary(mine)
            print(
                f"| `{file.name}` | {path} | {total['jobs_run']} | {total['kills']} | {total['committed_steps']} | "
                f"{total['longest_wait_s']:.1f} s | {total['failed_jobs']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=1000, help="SIGKILLs to carry out in all")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--kills-per-job", type=int, default=40, help="a fresh job after this many (event logs grow)")
    parser.add_argument("--spacing", type=int, default=4, help="committed steps between two kills' steps")
    parser.add_argument(
        "--paths", nargs="+", choices=sorted(FAULT_SCHEDULE_PATHS), default=sorted(FAULT_SCHEDULE_PATHS)
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-waits-over",
        type=float,
        default=30.0,
        help="keep the folder of a job whose longest wait exceeds this many seconds (a failed job's is always kept)",
    )
    parser.add_argument("--out", type=Path, help="a new file (default: results/soak/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--report", type=Path, nargs="+", help="print the table of these kept results, run nothing")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    out = new_results_file("soak", args.out, args.label)
    with tempfile.TemporaryDirectory(prefix="lightning-ft-soak-") as scratch:
        records = run(args, Path(scratch), out)
    save(out, args, records, complete=True)
    print(f"soak: {summary(records)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""How long the survivors stall after a kill, over many kills of a 3-group job, on each training path.

Three replica groups of the test worker (``tests/support/workers/train_worker.py``) under ``lightning-ft launch``,
with the launcher's defaults (heartbeat timeout 1 s); one group after another is SIGKILLed (in turn 0, 1, 2), and the
survivors' longest time without a commit, from the kill until the restarted group is back, is recorded; once the
restarted group commits with both others again, the next kill follows. ``--path`` picks the training path (DDP's
hook, FSDP2's hook in HSDP, DiLoCo's syncs); ``--where`` where the kill lands:

* ``random``: at a random moment of training (forward, backward, the allreduce of these short steps);
* ``batch_start``: held at the start of a batch, before its quorum;
* ``quorum``: held with its quorum's answer in hand, before acting on it, while the others already do;
* ``allreduce``: held inside its next cross-group collective, its peers waiting in theirs;
* ``heal``: the group is killed once, and its restart is killed in the middle of its heal (the survivors' heal
  sends are held half-way until then); the wait is counted from that second kill;
* ``mixed`` cycles through the five.

A wait over ``--bound`` seconds (the heartbeat timeout plus one second) is counted. A fresh job is started every
``--kills-per-job`` kills (the event logs it reads grow with every step). The job is started and watched with the
test harness (``tests/support/harness.py``, through ``benchmarks/common/process_harness.py``). Each run writes a new
file, ``benchmarks/results/kill_loop/<UTC>_<commit>[_<label>].json``. Usage::

    python -m benchmarks.kill_loop.kill_loop --kills 27        # about 5 minutes on 2 cores
    python -m benchmarks.kill_loop.kill_loop --path diloco --where mixed --kills 30 --label diloco
    python -m benchmarks.kill_loop.kill_loop --report benchmarks/results/kill_loop/*_r2_*.json   # the kept runs' table
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common.process_harness import LaunchedJob, launch_job
from benchmarks.common.results import header, new_results_file

STALL_S = 5.0  # a survivor that commits later than this after a kill waited for more than the heartbeat timeout
BOUND_S = 2.0  # the launcher's heartbeat timeout (1 s) plus one second
PATHS = {
    "ddp": [],
    "hsdp": ["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0"],
    "diloco": ["--algorithm=diloco", "--sync-every=4", "--async-quorum=0"],
}
WHERE = ("random", "batch_start", "quorum", "allreduce", "heal")


def commits_together_after(job: LaunchedJob, since: float) -> bool:
    steps = job.events("step", committed=True, participants=3)
    return all(any(e["time"] > since and e["group"] == g for e in steps) for g in range(3))


def first_commit_after(job: LaunchedJob, group: int, since: float) -> float | None:
    times = [e["time"] for e in job.events("step", group=group, committed=True) if e["time"] > since]
    return min(times) if times else None


def hold_at(job: LaunchedJob, group: int, pid: int, where: str) -> Path:
    """Touch ``group``'s gate for ``where`` and wait until its process ``pid`` stops there; returns the gate."""
    gate = job.root / f"pause.group{group}.{where}"
    since = time.time()
    gate.touch()
    job.wait_for(f"group {group} to stop at {where}", lambda: any(
        e["time"] > since for e in job.events("paused", group=group, pid=pid, phase=where)))  # fmt: skip
    return gate


def kill_in_heal(job: LaunchedJob, victim: int, survivors: list[int], attempt: int, pid: int) -> tuple[float, int]:
    """Kill ``victim`` once, then its restart in the middle of its heal; returns the second kill's time and the
    restart attempt it was."""
    sends = [job.root / f"pause.group{g}.heal_send" for g in survivors]
    for send in sends:
        send.touch()
    try:
        first_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        healing = job.wait_for("the restart", lambda: job.worker_pid(victim, 0, attempt + 1))
        job.wait_for("a survivor to be half-way through the heal's send", lambda: any(
            e["time"] > first_kill for e in job.events("paused", phase="heal_send")))  # fmt: skip
        killed_at = time.time()
        os.kill(healing, signal.SIGKILL)
    finally:
        for send in sends:
            send.unlink(missing_ok=True)
    return killed_at, attempt + 1


def kill_once(job: LaunchedJob, victim: int, where: str, rng: random.Random) -> list[float]:
    """SIGKILL ``victim`` at ``where``; return each survivor's longest wait, once the victim is back and all commit."""
    survivors = [g for g in range(3) if g != victim]
    attempt = job.attempt(victim, 0)
    pid = job.worker_pid(victim, 0, attempt)
    if where == "heal":
        killed_at, attempt = kill_in_heal(job, victim, survivors, attempt, pid)
    else:
        gate = None
        if where == "random":
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            gate = hold_at(job, victim, pid, where)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        if gate is not None:
            gate.unlink()
    job.wait_for("the survivors to commit", lambda: all(first_commit_after(job, g, killed_at) for g in survivors))
    job.wait_for("the restart", lambda: job.worker_pid(victim, 0, attempt + 1))
    back_at = time.time()
    job.wait_for("every group to commit together again", lambda: commits_together_after(job, back_at))
    return [longest_wait(job, g, killed_at, back_at) for g in survivors]


def longest_wait(job: LaunchedJob, group: int, killed_at: float, back_at: float) -> float:
    """The survivor's longest time without a commit from the kill until the restarted group was back: about the
    heartbeat timeout when the death is detected as it should be, the lighthouse's join timeout when it stalls."""
    commits = sorted(e["time"] for e in job.events("step", group=group, committed=True) if e["time"] > killed_at)
    until_back = [t for t in commits if t <= back_at] + [t for t in commits if t > back_at][:1]
    return round(max(b - a for a, b in itertools.pairwise([killed_at, *until_back])), 3)


def run_job(kills: list[int], root: Path, path: str, where: str, rng: random.Random) -> list[dict]:
    """One 3-group job, killed once for each of ``kills`` (the campaign's kill numbers)."""
    job = launch_job(
        root,
        groups=3,
        max_restarts=2 * len(kills) + 2,
        worker_args=["--max-steps=1000000", "--timeout=30", "--gate-dir={root}", *PATHS[path]],
    )
    records: list[dict] = []
    try:
        job.wait_for("every Manager to start", lambda: all(job.worker_pid(g, 0) for g in range(3)), timeout=120)
        (job.root / "go").touch()
        job.wait_for("every group to commit together", lambda: commits_together_after(job, 0.0), timeout=120)
        for kill in kills:
            at = WHERE[kill % len(WHERE)] if where == "mixed" else where
            delays = kill_once(job, victim=kill % 3, where=at, rng=rng)
            records.append({"victim": kill % 3, "where": at, "delays_s": delays})
            print(f"kill {kill} of group {kill % 3} at {at}: the survivors' longest waits {delays} s", flush=True)
    finally:
        job.stop()
    return records


def run(kills: int, root: Path, path: str, where: str, seed: int, per_job: int) -> list[dict]:
    rng = random.Random(seed)
    records: list[dict] = []
    for first in range(0, kills, per_job):
        numbers = list(range(first, min(kills, first + per_job)))
        records += run_job(numbers, root / f"job{first // per_job}", path, where, rng)
    return records


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(paths: list[Path], bound: float) -> None:
    """A markdown table of kept runs: per path, and per kill point, the survivors' longest waits."""
    print("| path | kill point | kills | median | p99 | max | over the bound |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for path in paths:
        result = json.loads(path.read_text())
        kills = result["kills"]
        for where in ["all", *WHERE]:
            worst = [max(k["delays_s"]) for k in kills if where in ("all", k["where"])]
            if not worst:
                continue
            over = sum(w > bound for w in worst)
            name = f"{result['path']} (`{path.name}`)" if where == "all" else ""
            print(
                f"| {name} | {where} | {len(worst)} | {statistics.median(worst):.2f} s | "
                f"{percentile(worst, 0.99):.2f} s | {max(worst):.2f} s | {over} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=27)
    parser.add_argument("--path", choices=sorted(PATHS), default="ddp")
    parser.add_argument("--where", choices=[*WHERE, "mixed"], default="random")
    parser.add_argument("--bound", type=float, default=BOUND_S)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills-per-job", type=int, default=10)
    parser.add_argument("--out", type=Path, help="a new file (default: results/kill_loop/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--keep", type=Path, default=None, help="run the job in this directory and keep its logs")
    parser.add_argument("--report", type=Path, nargs="+", help="print the table of these kept results, run nothing")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.bound)
        return
    args.out = new_results_file("kill_loop", args.out, args.label)
    if args.keep is not None:
        records = run(args.kills, args.keep, args.path, args.where, args.seed, args.kills_per_job)
    else:
        with tempfile.TemporaryDirectory(prefix="lightning-ft-kill-loop-") as scratch:
            records = run(args.kills, Path(scratch), args.path, args.where, args.seed, args.kills_per_job)
    worst = [max(r["delays_s"]) for r in records]
    over = sum(delay > args.bound for delay in worst)
    summary = {
        "median_s": statistics.median(worst),
        "p99_s": percentile(worst, 0.99),
        "max_s": max(worst),
        "over_bound": over,
        "bound_s": args.bound,
    }
    print(f"{args.path}, {args.where}, {len(records)} kills: {summary}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**header(), "path": args.path, "where": args.where, "kills": records, **summary}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

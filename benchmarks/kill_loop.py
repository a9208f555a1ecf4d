"""How long the survivors stall after a kill, over many kills of a 3-group job (the 10-s stall of issue 7).

Three replica groups of the test worker (``tests/processes/workers/train_worker.py``) under ``lightning-ft launch``,
with the launcher's defaults; every few seconds one group is SIGKILLed (in turn 0, 1, 2), and the time from the kill to
each survivor's next committed step is recorded; once the restarted group commits with both others again, the next kill
follows. The job is started and watched with the test harness (``tests/processes/harness.py``). Usage::

    python benchmarks/kill_loop.py --kills 27        # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run_util import REPO, RESULTS, machine

sys.path.insert(0, str(REPO / "tests"))
from harness import LaunchedJob, launch_job

STALL_S = 5.0  # a survivor that commits later than this after a kill waited for more than the heartbeat timeout


def commits_together_after(job: LaunchedJob, since: float) -> bool:
    steps = job.events("step", committed=True, participants=3)
    return all(any(e["time"] > since and e["group"] == g for e in steps) for g in range(3))


def first_commit_after(job: LaunchedJob, group: int, since: float) -> float | None:
    times = [e["time"] for e in job.events("step", group=group, committed=True) if e["time"] > since]
    return min(times) if times else None


def kill_once(job: LaunchedJob, victim: int) -> list[float]:
    """SIGKILL ``victim``; return each survivor's delay to its next commit, once the victim is back and all commit."""
    survivors = [g for g in range(3) if g != victim]
    attempt = job.attempt(victim, 0)
    killed_at = time.time()
    os.kill(job.worker_pid(victim, 0, attempt), signal.SIGKILL)
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


def run(kills: int, root: Path) -> list[list[float]]:
    job = launch_job(root, groups=3, max_restarts=kills + 2, worker_args=["--max-steps=1000000", "--timeout=30"])
    delays: list[list[float]] = []
    try:
        job.wait_for("every group to commit together", lambda: commits_together_after(job, 0.0), timeout=120)
        for kill in range(kills):
            delays.append(kill_once(job, victim=kill % 3))
            print(f"kill {kill} of group {kill % 3}: the survivors' longest waits {delays[-1]} s", flush=True)
    finally:
        job.stop()
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=27)
    parser.add_argument("--out", type=Path, default=RESULTS / "kill_loop.json")
    parser.add_argument("--keep", type=Path, default=None, help="run the job in this directory and keep its logs")
    args = parser.parse_args()
    if args.keep is not None:
        delays = run(args.kills, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="lightning-ft-kill-loop-") as scratch:
            delays = run(args.kills, Path(scratch))
    worst = [max(pair) for pair in delays]
    stalls = sum(delay > STALL_S for delay in worst)
    print(f"{args.kills} kills: median {statistics.median(worst):.2f} s, {stalls} stalls over {STALL_S:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "kills": args.kills, "delays_s": delays, "stalls_over_5s": stalls}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

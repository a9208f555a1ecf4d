"""Kills at N groups: the survivors' stall and the time until every victim has healed, one victim against k at once.

One job of N replica groups of the test worker (``tests/support/workers/train_worker.py``, 1 process each) under
``lightning-ft launch`` with its defaults, per N and repetition, and two rounds of kills in it:

1. one group SIGKILLed alone (a single heal);
2. once it has healed and every group commits together again, a quarter of the groups (k = N/4, at least 1)
   SIGKILLed in the same moment (k heals at once).

Per round: the survivors' longest time without a commit from the kill until every victim has healed, the time from
the kill until the last victim's ``healed`` event, each victim's receive time, and the groups they healed from
(``healed``'s ``source_replica_rank`` mapped to a group through that quorum's ``quorum`` events): torchft assigns
simultaneous heals to the up-to-date replicas round robin, so k victims should heal from k different sources. The
job is started and watched with the test harness (``tests/support/harness.py``, through
``benchmarks/common/process_harness.py``). Usage::

    python -m benchmarks.scale.scale_kills                    # N = 4, 8, 16, 2 repetitions (about 10 minutes)
    python -m benchmarks.scale.scale_kills --groups 8 --repeats 1 --out /tmp/scale_kills.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.process_harness import LaunchedJob, launch_job
from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import median


def committed_together_since(job: LaunchedJob, groups: int, since: float) -> bool:
    steps = job.events("step", committed=True, participants=groups)
    return all(any(e["time"] > since and e["group"] == g for e in steps) for g in range(groups))


def heal_source(job: LaunchedJob, heal: dict[str, Any]) -> int | None:
    """The group whose ``quorum`` event for the heal's quorum gave it the heal's source replica rank."""
    if heal.get("source_replica_rank") is None:
        return None
    for quorum in job.events("quorum", quorum_id=heal["quorum_id"]):
        if quorum["replica_rank"] == heal["source_replica_rank"]:
            return quorum["group"]
    return None


def kill_round(job: LaunchedJob, groups: int, victims: list[int]) -> dict[str, Any]:
    """SIGKILL ``victims`` at once; wait until each restart has healed and every group commits together again."""
    attempts = {g: job.attempt(g, 0) for g in victims}
    pids = [job.worker_pid(g, 0, attempts[g]) for g in victims]
    killed_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    restarted = {
        g: job.wait_for(f"group {g}'s restart", lambda g=g: job.worker_pid(g, 0, attempts[g] + 1), 240) for g in victims
    }
    heals = {
        g: job.wait_for(f"group {g} to heal", lambda p=pid: job.events("healed", pid=p), 240)[0]
        for g, pid in restarted.items()
    }
    healed_at = max(heal["time"] for heal in heals.values())
    job.wait_for("every group to commit together", lambda: committed_together_since(job, groups, healed_at), 240)
    survivors = [g for g in range(groups) if g not in victims]
    stalls = []
    for group in survivors:
        commits = sorted(e["time"] for e in job.events("step", group=group, committed=True) if e["time"] > killed_at)
        until = [t for t in commits if t <= healed_at] + [t for t in commits if t > healed_at][:1]
        stalls.append(max(b - a for a, b in itertools.pairwise([killed_at, *until])))
    sources = {g: heal_source(job, heal) for g, heal in heals.items()}
    return {
        "victims": victims,
        "survivor_stall_s": round(max(stalls), 3),
        "all_healed_after_s": round(healed_at - killed_at, 3),
        "receive_s": {g: heal.get("receive_seconds") for g, heal in heals.items()},
        "heal_step": {g: heal["step"] for g, heal in heals.items()},
        "sources": sources,
        "distinct_sources": len({s for s in sources.values() if s is not None}),
    }


def run_job(groups: int, root: Path) -> list[dict[str, Any]]:
    job = launch_job(
        root, groups=groups, max_restarts=4, worker_args=["--max-steps=1000000", "--timeout=60", "--gate-dir={root}"]
    )
    rounds = []
    try:
        job.wait_for("every Manager to start", lambda: all(job.worker_pid(g, 0) for g in range(groups)), 300)
        (job.root / "go").touch()
        job.wait_for("every group to commit together", lambda: committed_together_since(job, groups, 0.0), 300)
        quarter = max(1, groups // 4)
        quarter_victims = list(range(1, groups, max(1, groups // quarter)))[:quarter]
        for name, victims in (("one", [groups - 1]), ("quarter", quarter_victims)):
            record = kill_round(job, groups, victims)
            rounds.append({"groups": groups, "round": name, "killed": len(victims), **record})
            print(
                f"  N={groups:2d}, {len(victims)} killed {victims}: survivors' stall "
                f"{record['survivor_stall_s']:.2f} s, all healed after {record['all_healed_after_s']:.2f} s, "
                f"sources {record['sources']}",
                flush=True,
            )
    finally:
        job.stop()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="a new file (default: results/scale_kills/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("scale_kills", args.out, args.label)  # every run is kept
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lightning-ft-scale-kills-") as scratch:
        for rep, groups in itertools.product(range(args.repeats), args.groups):
            for record in run_job(groups, Path(scratch) / f"{groups}-{rep}"):
                rounds.append({"rep": rep, **record})
    summary = []
    for groups, name in sorted({(r["groups"], r["round"]) for r in rounds}):
        mine = [r for r in rounds if r["groups"] == groups and r["round"] == name]
        summary.append(
            {
                "groups": groups,
                "round": name,
                "killed": mine[0]["killed"],
                "rounds": len(mine),
                "survivor_stall_s": median([r["survivor_stall_s"] for r in mine]),
                "survivor_stall_max_s": max(r["survivor_stall_s"] for r in mine),
                "all_healed_after_s": median([r["all_healed_after_s"] for r in mine]),
                "receive_s": median([s for r in mine for s in r["receive_s"].values() if s is not None]),
                "distinct_sources": [r["distinct_sources"] for r in mine],
            }
        )
        print(json.dumps(summary[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header(), "rounds": rounds, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

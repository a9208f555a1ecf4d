"""What grows with the number of replica groups: step time and quorum wait at N = 2, 4, 8, 16 groups of 1 process.

Each run is a real job on this machine, 1 compute thread per process, a tiny model (``common/bench_model.py``,
``SIZES["tiny"]``,
17k parameters, batch 16) so that what crosses groups dominates the step:

* ``ddp``: ``torchrun --nproc-per-node N`` running Lightning with ``DDPStrategy(process_group_backend="gloo")``: one
  world of N processes, the baseline;
* ``ft``: ``lightning-ft launch --replica-groups N --min-replicas N`` running Lightning with ``FTStrategy()``
  (asynchronous quorum, event log on), N groups of 1 process.

The figure of a run is the median time between consecutive optimizer steps after a warm-up, averaged over its N
processes, and for ``ft`` the training thread's median wait for each step's quorum; the modes alternate order in
each repetition, and the ratio is ft against ddp of the same N and repetition (paired), then the median over
repetitions. With N processes on 2 cores, every process gets 2/N of a core: the absolute step time grows with N in
both modes, and the ratio is what shows whether fault tolerance adds a cost that grows faster than the baseline's.
``--fit`` fits each figure against N as a constant, log N and N, and names the best. Usage::

    python -m benchmarks.scale.scale                             # N = 2, 4, 8, 16, 2 repetitions: ~10 minutes
    python -m benchmarks.scale.scale --groups 2 4 --repeats 1 --out /tmp/scale.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import BENCH, LIGHTNING_FT, median, run_job

STEPS = 200
WARMUP = 40  # step intervals skipped: process start, the first heal, allocator warm-up
WORKER = BENCH / "common" / "overhead_worker.py"


def command(mode: str, groups: int, root: Path, probe_every: int = 0) -> list[str]:
    worker = [str(WORKER), f"--mode={mode}", "--size=tiny", f"--steps={STEPS}", f"--root={root}"]
    worker += [f"--out={root / 'steps.json'}", f"--probe-every={probe_every}"]
    if mode == "ddp":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={groups}"]
        return [*torchrun, *worker, f"--processes={groups}"]
    launch = [*LIGHTNING_FT, "launch", f"--replica-groups={groups}", f"--min-replicas={groups}", "--max-restarts=0"]
    return [*launch, "--", "python", *worker]


def measure(mode: str, groups: int, scratch: Path, rep: int, probe_every: int = 0) -> dict[str, Any]:
    root = scratch / f"{groups}-{mode}-{rep}"
    code = run_job(command(mode, groups, root, probe_every), root / "job.log", timeout=600)
    files = sorted(root.glob("steps.*.json"))
    if code != 0 or len(files) != groups:
        raise RuntimeError(f"{mode}/{groups} failed (exit {code}, {len(files)} step records); see {root / 'job.log'}")
    steps, waits = [], []
    probes: dict[str, list[float]] = {"probe_in_step_s": [], "probe_section_s": [], "probe_validation_s": []}
    for path in files:
        record = json.loads(path.read_text())
        for key, values in probes.items():
            if record.get(key):
                values.append(median(record[key][len(record[key]) // 5 :]))  # after the warm-up fifth
        steps.append(median([b - a for a, b in itertools.pairwise(record["step_ends"])][WARMUP:]))
        if "quorum_wait_s_by_step" in record:
            totals = record["quorum_wait_s_by_step"]
            waits.append(median([b - a for a, b in itertools.pairwise(totals)][WARMUP:]))
    run: dict[str, Any] = {"mode": mode, "groups": groups, "rep": rep, "step_s": sum(steps) / len(steps)}
    if waits:
        run["quorum_wait_s"] = sum(waits) / len(waits)
    for key, values in probes.items():  # the processes' mean of their median latencies
        if values:
            run[key] = sum(values) / len(values)
    print(f"  N={groups:2d} {mode:3s} rep {rep}: {run['step_s'] * 1000:7.2f} ms/step", flush=True)
    return run


def best_fit(ns: list[int], values: list[float]) -> dict[str, Any]:
    """Least squares of ``values`` against a + b·g(N) for g = 0 (constant), log N and N; the smallest residual wins
    (a constant wins ties: it has one parameter fewer)."""
    fits = {}
    for name, g in (("constant", None), ("log N", math.log), ("N", float)):
        if g is None or len(set(ns)) < 2:  # one N: only a constant can be fitted
            a, b = sum(values) / len(values), 0.0
        else:
            xs = [g(n) for n in ns]
            mx, my = sum(xs) / len(xs), sum(values) / len(values)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sum((x - mx) ** 2 for x in xs)
            a = my - b * mx
        predicted = [a + b * (0 if g is None else g(n)) for n in ns]
        fits[name] = {"a": a, "b": b, "rss": sum((y - p) ** 2 for y, p in zip(values, predicted, strict=True))}
    best = min(fits, key=lambda name: fits[name]["rss"] * (1.0 if name == "constant" else 1.05))
    return {"best": best, **fits[best]}


def summarise(runs: list[dict[str, Any]], groups: list[int]) -> dict[str, Any]:
    rows = []
    for n in groups:
        ft = [r for r in runs if r["groups"] == n and r["mode"] == "ft"]
        ddp = {r["rep"]: r for r in runs if r["groups"] == n and r["mode"] == "ddp"}
        ratios = [r["step_s"] / ddp[r["rep"]]["step_s"] for r in ft if r["rep"] in ddp]
        rows.append(
            {
                "groups": n,
                "ddp_step_ms": 1000 * median([r["step_s"] for r in ddp.values()]),
                "ft_step_ms": 1000 * median([r["step_s"] for r in ft]),
                "ft_quorum_wait_ms": 1000 * median([r["quorum_wait_s"] for r in ft]),
                "paired_ratio": median(ratios),
                "ratios": ratios,
            }
        )
        # With --probe-every: each mode's median latency.
        for key in ("probe_in_step_s", "probe_section_s", "probe_validation_s"):
            for mode, mine in (("ft", ft), ("ddp", list(ddp.values()))):
                if any(key in r for r in mine):
                    rows[-1][f"{mode}_{key[:-2]}_ms"] = 1000 * median([r[key] for r in mine if key in r])
    ns = [row["groups"] for row in rows]
    fits = {
        key: best_fit(ns, [row[key] for row in rows])
        for key in ("ddp_step_ms", "ft_step_ms", "ft_quorum_wait_ms", "paired_ratio")
    }
    return {"rows": rows, "fits": fits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="every N steps, time a job-wide reduction inside the step (self.log(sync_dist=True)) and one between "
        "steps (strategy.reduce: in FTStrategy group-local outside a section) and a validation run of 2 batches "
        "(val_check_interval=N) logging its loss with sync_dist=True: in FTStrategy a sync section across groups",
    )
    parser.add_argument("--out", type=Path, help="a new file (default: results/scale/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("scale", args.out, args.label)  # every run is kept
    runs = []
    with tempfile.TemporaryDirectory(prefix="lightning-ft-scale-") as scratch:
        for rep in range(args.repeats):
            for n in args.groups:
                for mode in ("ddp", "ft") if rep % 2 == 0 else ("ft", "ddp"):
                    runs.append(measure(mode, n, Path(scratch), rep, args.probe_every))
    summary = summarise(runs, args.groups)
    for row in summary["rows"]:
        print(
            f"N={row['groups']:2d}: ddp {row['ddp_step_ms']:7.2f} ms, ft {row['ft_step_ms']:7.2f} ms "
            f"(quorum wait {row['ft_quorum_wait_ms']:5.2f} ms), ft/ddp {row['paired_ratio']:.3f}"
        )
    for key, fit in summary["fits"].items():
        print(f"{key}: best fit {fit['best']} (a={fit['a']:.3f}, b={fit['b']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in summary["rows"]:
        probes = {key: round(value, 3) for key, value in row.items() if "probe" in key}
        if probes:
            print(f"N={row['groups']:2d} probes (ms): {probes}")
    record = {**header(), "steps": STEPS, "probe_every": args.probe_every, "runs": runs, **summary}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Step time of FTStrategy against Lightning's DDPStrategy, with raw torchft DDP as a second anchor (issue 7).

Each run is a real job of 2 processes on this machine, 1 compute thread each:

* ``ddp``: ``torchrun --nproc-per-node 2`` running Lightning with ``DDPStrategy(process_group_backend="gloo")``;
* ``ft``: ``lightning-ft launch --replica-groups 2 --min-replicas 2`` running Lightning with ``FTStrategy()``
  (its defaults: asynchronous quorum, event log on), 2 groups of 1 process;
* ``torchft``: the same launcher running torchft's README loop without Lightning (``torchft.ddp``,
  ``OptimizerWrapper``);
* ``ddp_view`` (only with ``--modes``): ``ddp`` with ``DDPStrategy(gradient_as_bucket_view=True)``, FTStrategy's
  default, so that what the setting saves is seen apart from what fault tolerance costs.

The figure of a run is the median time between consecutive optimizer steps after a warm-up, averaged over its two
processes in every mode (both ranks of ``ddp``, both groups of ``ft``; until 2026-11-26 ``ddp`` was taken from rank 0
alone); the figure of a mode is the median over repetitions, which alternate the order of the modes. Ratios are
against ``ddp`` of the same size. Each repetition also gives a paired ratio (a mode's run against the ``ddp`` run of
the same repetition, taken minutes apart at most), and their median is reported beside the ratio of medians: the
machine's speed drifts by 10-30 % over minutes, and pairing cancels the slow part of that drift. The peak RSS is the
largest of the run's training processes. Usage::

    python -m benchmarks.overhead.overhead        # both sizes (about 5 minutes on 2 cores), a new results file
    python -m benchmarks.overhead.overhead --sizes 1m --repeats 1
    python -m benchmarks.overhead.overhead --sizes 1m --repeats 12 --modes ddp ft --label 1m_12reps
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import BENCH, LIGHTNING_FT, median, run_job

MODES = ("ddp", "ft", "torchft")  # what a run measures unless --modes says otherwise
# ddp_view: DDPStrategy(gradient_as_bucket_view=True), the like-for-like anchor for FTStrategy's default of the same
ALL_MODES = ("ddp", "ddp_view", "ft", "torchft")
STEPS = {"1m": 300, "50m": 20}
WARMUP = {"1m": 50, "50m": 4}  # step intervals skipped: process start, init_sync's heal, allocator warm-up
REPEATS = {"1m": 3, "50m": 2}  # a 50M run takes about 40 s here; its steps vary less
PROCESSES = 2  # training processes per run, in every mode; each writes its own step record
# How a run's figure was taken, written into its results file so that report.py can tell runs apart: "both_ranks",
# both processes averaged in every mode. Files without it (before 2026-11-26) averaged ft's two groups but took ddp
# from rank 0 alone.
MEASUREMENT = "both_ranks"
WORKER = BENCH / "common" / "overhead_worker.py"


def command(mode: str, size: str, root: Path) -> list[str]:
    worker = [
        str(WORKER),
        f"--mode={'ddp' if mode == 'ddp_view' else mode}",
        f"--size={size}",
        f"--steps={STEPS[size]}",
        f"--root={root}",
        f"--out={root / 'steps.json'}",
    ]
    if mode in ("ddp", "ddp_view"):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        if mode == "ddp_view":
            worker.append('--ddp-args={"gradient_as_bucket_view": true}')
        return [*torchrun, *worker]
    launch = [*LIGHTNING_FT, "launch", "--replica-groups=2", "--min-replicas=2", "--max-restarts=0"]
    return [*launch, "--", "python", *worker]


def measure(mode: str, size: str, scratch: Path, rep: int) -> dict[str, Any]:
    root = scratch / f"{size}-{mode}-{rep}"
    load = os.getloadavg()[0]  # the 1-minute load as the job starts: another job on the machine shows here
    code = run_job(command(mode, size, root), root / "job.log", timeout=300)
    files = sorted(root.glob("steps.*.json"))
    if code != 0 or len(files) != PROCESSES:  # every mode's figure averages the same number of processes
        raise RuntimeError(f"{mode}/{size} failed (exit {code}, {len(files)} step records); see {root / 'job.log'}")
    medians, rss, waits = [], [], []
    for path in files:
        record = json.loads(path.read_text())
        ends = record["step_ends"]
        intervals = [b - a for a, b in itertools.pairwise(ends)][WARMUP[size] :]
        medians.append(median(intervals))
        rss.append(record["peak_rss_bytes"])
        if "quorum_wait_s_by_step" in record:  # ft: the training thread's wait for each step's quorum
            totals = record["quorum_wait_s_by_step"]
            waits.append(median([b - a for a, b in itertools.pairwise(totals)][WARMUP[size] :]))
        if record["global_step"] != STEPS[size]:
            raise RuntimeError(f"{mode}/{size}: reached step {record['global_step']}, not {STEPS[size]}")
    step = sum(medians) / len(medians)  # the same two processes averaged in every mode
    print(f"  {size} {mode:8s} rep {rep}: {step * 1000:7.2f} ms/step, peak RSS {max(rss) / 2**20:6.0f} MiB", flush=True)
    run = {
        "mode": mode,
        "size": size,
        "rep": rep,
        "step_s": step,
        "per_process_step_s": medians,
        "rss": max(rss),
        "loadavg_1m_start": load,
    }
    if waits:
        run["quorum_wait_s"] = sum(waits) / len(waits)
    return run


def paired_ratios(runs: list[dict[str, Any]], size: str, mode: str) -> list[float]:
    """``mode`` ÷ ``ddp`` within each repetition of ``size`` that has both."""
    by_rep: dict[int, dict[str, float]] = {}
    for run in runs:
        if run["size"] == size:
            by_rep.setdefault(run["rep"], {})[run["mode"]] = run["step_s"]
    return [steps[mode] / steps["ddp"] for _, steps in sorted(by_rep.items()) if mode in steps and "ddp" in steps]


def summarise(runs: list[dict[str, Any]], sizes: list[str], modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        base = median([r["step_s"] for r in runs if r["size"] == size and r["mode"] == "ddp"])
        base_rss = median([r["rss"] for r in runs if r["size"] == size and r["mode"] == "ddp"])
        for mode in modes:
            mine = [r for r in runs if r["size"] == size and r["mode"] == mode]
            step = median([r["step_s"] for r in mine])
            rss = median([r["rss"] for r in mine])
            paired = paired_ratios(runs, size, mode)
            rows.append(
                {
                    "size": size,
                    "mode": mode,
                    "step_ms": step * 1000,
                    "ratio_vs_ddp": step / base,
                    # each repetition's run against the ddp run of the same repetition
                    "paired_ratios": [round(r, 4) for r in paired],
                    "paired_ratio_median": median(paired),
                    "per_rep_ms": [round(r["step_s"] * 1000, 2) for r in mine],
                    "peak_rss_mib": rss / 2**20,
                    "rss_ratio_vs_ddp": rss / base_rss,
                    # ft only: the training thread's median wait for a step's quorum
                    "quorum_wait_ms": median([r["quorum_wait_s"] * 1000 for r in mine if "quorum_wait_s" in r])
                    if mode == "ft"
                    else None,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1m", "50m"], choices=sorted(STEPS))
    parser.add_argument("--repeats", type=int, default=None, help="per size (default: 3 at 1M, 2 at 50M)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES, help="ddp is always run")
    parser.add_argument("--out", type=Path, help="a new file (default: results/overhead/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("overhead", args.out, args.label)
    modes = tuple(m for m in ALL_MODES if m == "ddp" or m in args.modes)
    runs: list[dict[str, Any]] = []
    load_start = os.getloadavg()  # the machine's load, so that a reader can judge how quiet the run was
    with tempfile.TemporaryDirectory(prefix="lightning-ft-overhead-") as scratch:
        for size in args.sizes:
            for rep in range(args.repeats or REPEATS[size]):
                order = modes if rep % 2 == 0 else tuple(reversed(modes))
                for mode in order:
                    runs.append(measure(mode, size, Path(scratch), rep))
    rows = summarise(runs, args.sizes, modes)
    for row in rows:
        print(
            f"{row['size']:>4} {row['mode']:8s} {row['step_ms']:8.2f} ms  {row['ratio_vs_ddp']:.3f}x ddp  "
            f"(paired: median {row['paired_ratio_median']:.3f}x of {len(row['paired_ratios'])})  "
            f"RSS {row['peak_rss_mib']:.0f} MiB ({row['rss_ratio_vs_ddp']:.2f}x)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **header(),
        "measurement": MEASUREMENT,
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "rows": rows,
        "runs": runs,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""What the buffer average costs (``FTStrategy(buffer_sync="average")``, the default): step time against
``buffer_sync="off"``, side by side on a buffer-heavy model (docs/benchmarks.md, *Buffers*).

Each run is a real job of 2 replica groups of 1 process (``lightning-ft launch --replica-groups 2``), 1 compute thread
each, on the ``1m_bn`` MLP of ``common/bench_model.py`` (a BatchNorm after every Linear: 1.06 M parameters, 24 buffers).
The two settings alternate within each repetition (the order flips every repetition); the figure of a run is the
median time between consecutive optimizer steps after a warm-up, averaged over both groups; the verdict is the
median of the paired ratios (average ÷ off within a repetition). Usage::

    python -m benchmarks.buffers.buffers          # 3 repetitions, about 3 minutes on 2 cores, a new results file
    python -m benchmarks.buffers.buffers --repeats 5 --size 1m_bn
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

SETTINGS = ("off", "average")
STEPS, WARMUP = 300, 50
WORKER = BENCH / "common" / "overhead_worker.py"


def measure(setting: str, size: str, scratch: Path, rep: int) -> dict[str, Any]:
    root = scratch / f"{setting}-{rep}"
    worker = [
        str(WORKER),
        "--mode=ft",
        f"--size={size}",
        f"--steps={STEPS}",
        f"--root={root}",
        f"--out={root / 'steps.json'}",
        f"--ft-args={json.dumps({'buffer_sync': setting})}",
    ]
    launch = [*LIGHTNING_FT, "launch", "--replica-groups=2", "--min-replicas=2", "--max-restarts=0"]
    code = run_job([*launch, "--", "python", *worker], root / "job.log", timeout=300)
    files = sorted(root.glob("steps.*.json"))
    if code != 0 or len(files) != 2:
        raise RuntimeError(f"{setting} failed (exit {code}, {len(files)} step records); see {root / 'job.log'}")
    medians = []
    for path in files:
        ends = json.loads(path.read_text())["step_ends"]
        medians.append(median([b - a for a, b in itertools.pairwise(ends)][WARMUP:]))
    step = sum(medians) / len(medians)
    print(f"  buffer_sync={setting:7s} rep {rep}: {step * 1000:7.3f} ms/step", flush=True)
    return {"setting": setting, "rep": rep, "step_s": step, "per_process_step_s": medians}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_rep: dict[int, dict[str, float]] = {}
    for run in runs:
        by_rep.setdefault(run["rep"], {})[run["setting"]] = run["step_s"]
    paired = [steps["average"] / steps["off"] for _, steps in sorted(by_rep.items())]
    added = [(steps["average"] - steps["off"]) * 1000 for _, steps in sorted(by_rep.items())]
    return {
        "off_ms": median([r["step_s"] * 1000 for r in runs if r["setting"] == "off"]),
        "average_ms": median([r["step_s"] * 1000 for r in runs if r["setting"] == "average"]),
        "paired_ratios": [round(r, 4) for r in paired],
        "paired_ratio_median": median(paired),
        "added_ms_per_step": [round(a, 3) for a in added],
        "added_ms_median": median(added),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="1m_bn")
    parser.add_argument("--out", type=Path, help="a new file (default: results/buffers/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("buffers", args.out, args.label)
    runs: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lightning-ft-buffers-") as scratch:
        for rep in range(args.repeats):
            for setting in SETTINGS if rep % 2 == 0 else tuple(reversed(SETTINGS)):
                runs.append(measure(setting, args.size, Path(scratch), rep))
    summary = summarise(runs)
    print(
        f"buffer_sync=average {summary['average_ms']:.3f} ms/step against off {summary['off_ms']:.3f}: paired ratio "
        f"median {summary['paired_ratio_median']:.4f}x, {summary['added_ms_median']:+.3f} ms per step"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **header(),
        "size": args.size,
        "steps": STEPS,
        "warmup": WARMUP,
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "summary": summary,
        "runs": runs,
        "argv": sys.argv[1:],
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

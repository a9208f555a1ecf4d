"""What exactly-once data costs: step time of ``FTStrategy(data_mode="exactly_once")`` against the sharded mode.

Exactly-once data needs a synchronous quorum (a step's samples depend on it), so it is measured against both the
default (sharded data, asynchronous quorum) and sharded data with a synchronous quorum, which isolates the cost of
the data mode itself: checking each batch against the quorum's placement, and the refetches when the loader's
prediction was wrong (none are expected while membership holds; each membership change costs two per group, the
batch in hand and the one loaded ahead, see ``docs/elasticity.md``). 2 groups × 1 process, the 1M-parameter model of
``overhead/overhead.py``, with the same workers and the same figure: the median step interval after a warm-up, the
median over repetitions that alternate the order of the modes. Usage::

    python -m benchmarks.data_modes.data_modes    # about 3 minutes on 2 cores, a new results file
    python -m benchmarks.data_modes.data_modes --repeats 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.bench_model import SIZES, SyntheticRegression
from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import BENCH, LIGHTNING_FT, median, run_job

SIZE, STEPS, WARMUP = "1m", 300, 50
WORKER = BENCH / "common" / "overhead_worker.py"
MODES: dict[str, dict[str, Any]] = {
    "sharded-async": {},  # FTStrategy's defaults
    "sharded-sync": {"use_async_quorum": False},
    "exactly-once": {"data_mode": "exactly_once"},
}


def measure(mode: str, scratch: Path, rep: int) -> dict[str, Any]:
    root = scratch / f"{mode}-{rep}"
    launch = [*LIGHTNING_FT, "launch", "--replica-groups=2", "--min-replicas=2", "--max-restarts=0"]
    worker = [
        str(WORKER),
        "--mode=ft",
        f"--size={SIZE}",
        f"--steps={STEPS}",
        f"--root={root}",
        f"--out={root / 'steps.json'}",
        f"--ft-args={json.dumps(MODES[mode])}",
    ]
    code = run_job([*launch, "--", "python", *worker], root / "job.log", timeout=300)
    files = sorted(root.glob("steps.*.json"))
    if code != 0 or not files:
        raise RuntimeError(f"{mode} failed (exit {code}); see {root / 'job.log'}")
    medians, refetches = [], 0
    for path in files:
        record = json.loads(path.read_text())
        if record["global_step"] != STEPS:
            raise RuntimeError(f"{mode}: reached step {record['global_step']}, not {STEPS}")
        medians.append(median([b - a for a, b in itertools.pairwise(record["step_ends"])][WARMUP:]))
        refetches += record.get("refetches", 0)
    step = sum(medians) / len(medians)
    print(f"  {mode:14s} rep {rep}: {step * 1000:7.2f} ms/step, refetches {refetches}", flush=True)
    return {"mode": mode, "rep": rep, "step_s": step, "refetches": refetches}


def refetch_seconds(samples: int = 200) -> float:
    """One refetch of this benchmark's batch: what a wrong prediction adds to a step (the dataset read and collate
    in the training process), timed here in-process."""
    from torch.utils.data import default_collate

    size = SIZES[SIZE]
    data = SyntheticRegression(size.width, size.batch_size, length=10 * size.batch_size)
    indices = list(range(size.batch_size))
    started = time.perf_counter()
    for _ in range(samples):
        default_collate([data[i] for i in indices])
    return (time.perf_counter() - started) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="a new file (default: results/data_modes/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("data_modes", args.out, args.label)
    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lightning-ft-data-modes-") as scratch:
        for rep in range(args.repeats):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs.append(measure(mode, Path(scratch), rep))
    base = median([r["step_s"] for r in runs if r["mode"] == "sharded-sync"])
    default = median([r["step_s"] for r in runs if r["mode"] == "sharded-async"])
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        step = median([r["step_s"] for r in mine])
        rows.append(
            {
                "mode": mode,
                "step_ms": step * 1000,
                "ratio_vs_sharded_sync": step / base,
                "ratio_vs_default": step / default,
                "per_rep_ms": [round(r["step_s"] * 1000, 2) for r in mine],
                "refetches": sum(r["refetches"] for r in mine),
            }
        )
        print(f"{mode:14s} {step * 1000:7.2f} ms  {step / base:.3f}x sharded-sync  {step / default:.3f}x default")
    refetch = refetch_seconds()
    print(f"one refetch of a {SIZES[SIZE].batch_size}-sample batch: {refetch * 1000:.3f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**header(), "rows": rows, "runs": runs, "refetch_ms": refetch * 1000, "steps": STEPS}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Step time of FTStrategy against DDPStrategy over a zoo of models (issue 25): what fault tolerance costs per step.

Each run is a real job of 2 processes on this machine, 1 compute thread each, training one model of
``zoo_models.py`` (an MLP, a CNN and a transformer at about 0.3 M, 1 M and 20 M parameters) with gradient
accumulation 1 or 4: ``ddp`` is ``torchrun --nproc-per-node 2`` with ``DDPStrategy(process_group_backend="gloo")``,
``ft`` is ``lightning-ft launch --replica-groups 2`` with ``FTStrategy()`` (its defaults). A run's figure is the median
time between optimizer steps after a warm-up, averaged over its two processes; a repetition's ratio is its ``ft`` run
÷ its ``ddp`` run (run back to back, the order alternating), and a model's verdict is the median of those ratios over
every repetition of every kept run (``benchmarks/results/zoo/``, but runs of ``--processes`` other than 2, labelled
``<N>-process``). The fixed cost is ``ft - ddp`` in milliseconds. Each run also samples the job's CPU seconds per step,
every process of it, the launcher and its lighthouse included (:mod:`benchmarks.common.job_cpu`): on 2 cores wall time
hides what a thread beside training costs. Usage::

    python -m benchmarks.zoo.zoo                    # every model, accumulation 1 and 4, 3 repetitions (~35 min)
    python -m benchmarks.zoo.zoo --models mlp-0.3m --accumulate 1 --repeats 1
    python -m benchmarks.zoo.zoo --summary          # the table and docs/img/zoo.png over every kept results file
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.job_cpu import cpu_per_step, cpu_per_step_by_kind, run_job_sampling_cpu
from benchmarks.common.results import RESULTS, every, header, new_results_file
from benchmarks.common.run_util import LIGHTNING_FT, REPO, median
from benchmarks.zoo.zoo_models import ZOO, parameter_count

# About how long one step of each model takes on one core here (one process, no exchange), to size a run's length.
NOMINAL_STEP_S = {
    "mlp-0.3m": 0.010,
    "mlp-1m": 0.030,
    "mlp-20m": 0.27,
    "cnn-0.3m": 0.05,
    "cnn-1m": 0.075,
    "cnn-20m": 0.5,
    "transformer-0.3m": 0.06,
    "transformer-1m": 0.075,
    "transformer-20m": 0.28,
}
MEASURED_S = 5.0  # the measured part of a run, roughly
PROCESSES = 2
WORKER = Path(__file__).with_name("zoo_worker.py")
# Modes that run DDPStrategy under torchrun; the others run FTStrategy under lightning-ft launch. ``ddp_torchft`` is
# DDPStrategy with torchft's per-step protocol beside it and no lightning-ft code (zoo_worker.TorchftProtocol),
# ``ddp_quorum`` with its quorum alone: the floors under ``ft`` that ``floor_split`` reports. ``ddp_as_ft`` is
# DDPStrategy with the DDP settings FTStrategy gives torch's DDP (its bucket cap, which makes one gradient bucket
# where DDP's default makes two, the unused-parameter search it chooses for the model, gradients as bucket views),
# and ``ddp_as_ft_quorum`` the same with torchft's quorum beside it: the floor with FTStrategy's buckets, above which
# is lightning-ft's own share.
FLOOR_MODES = {
    "ddp_torchft": "torchft's quorum and vote",
    "ddp_quorum": "torchft's quorum",
    "ddp_as_ft_quorum": "torchft's quorum and FTStrategy's DDP settings",
}
TORCHRUN_MODES = ("ddp", "ddp_as_ft", *FLOOR_MODES)
# Floor runs made before every benchmark process got lightning-ft launch's threads (run_util.bench_env): their torchft
# Managers ran tokio's default worker threads (2 here), FTStrategy's 1. Kept, outside the floor's split.
UNEQUAL_THREAD_FLOOR_RUNS = frozenset(
    {
        "20261130T175115Z_47e0d63_floor.json",
        "20261130T175732Z_47e0d63_floor.json",
        "20261130T181015Z_47e0d63_floor.json",
    }
)
MODES = (*TORCHRUN_MODES, "ft", "ft_pinned", "ft_sync")  # every mode of zoo_worker.py


def steps_for(model: str, accumulate: int) -> tuple[int, int]:
    """(optimizer steps, warm-up steps skipped) for about ``MEASURED_S`` of measured steps."""
    measured = max(12, min(200, math.ceil(MEASURED_S / (NOMINAL_STEP_S[model] * accumulate * 1.5))))
    warmup = max(4, measured // 5)
    return measured + warmup, warmup


def command(mode: str, model: str, accumulate: int, steps: int, root: Path, processes: int = PROCESSES) -> list[str]:
    worker = [
        str(WORKER),
        f"--mode={mode}",
        f"--model={model}",
        f"--accumulate={accumulate}",
        f"--steps={steps}",
        f"--root={root}",
        f"--out={root / 'steps.json'}",
    ]
    if mode in TORCHRUN_MODES:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *worker]
    launch = [*LIGHTNING_FT, "launch", f"--replica-groups={processes}", f"--min-replicas={processes}"]
    return [*launch, "--max-restarts=0", "--", "python", *worker]


def measure(
    mode: str, model: str, accumulate: int, rep: int, scratch: Path, processes: int = PROCESSES
) -> dict[str, Any]:
    steps, warmup = steps_for(model, accumulate)
    root = scratch / f"{model}-{accumulate}-{mode}-{rep}"
    load = os.getloadavg()[0]
    job = command(mode, model, accumulate, steps, root, processes)
    code, cpu_samples = run_job_sampling_cpu(job, root / "job.log", timeout=600, training_marker=WORKER.name)
    files = sorted(root.glob("steps.*.json"))
    if code != 0 or len(files) != processes:
        raise RuntimeError(f"{mode}/{model} failed (exit {code}, {len(files)} step records); see {root / 'job.log'}")
    medians = []
    paths: dict[str, list[float]] = {}
    cpu: float | None = None
    cpu_by_kind: dict[str, float] | None = None
    votes: list[float] = []
    for path in files:
        record = json.loads(path.read_text())
        if record["global_step"] != steps:
            raise RuntimeError(f"{mode}/{model}: reached step {record['global_step']}, not {steps}")
        medians.append(median([b - a for a, b in itertools.pairwise(record["step_ends"])][warmup:]))
        if cpu is None:  # the first process's steps count the job's: every process takes each committed step
            cpu = cpu_per_step(cpu_samples, record["step_ends"], warmup)
            cpu_by_kind = cpu_per_step_by_kind(cpu_samples, record["step_ends"], warmup)
        votes.extend(record.get("vote_seconds", [])[warmup:])
        for name in ("optimizer_ends", "vote_ends"):
            gap = to_next_forward(record.get(name, [])[warmup:], record.get("forward_starts", []))
            if gap is not None:
                paths.setdefault(name, []).append(gap)
    step = sum(medians) / len(medians)
    critical = {f"{name[:-5]}_to_forward_ms": 1000 * sum(gaps) / len(gaps) for name, gaps in paths.items()}
    if votes:  # the median vote (should_commit) over both processes' measured steps
        critical["vote_ms"] = 1000 * median(votes)
    shown = "  ".join(f"{name} {value:.3f}" for name, value in critical.items())
    cpu_ms = f"  job CPU {cpu * 1000:7.2f} ms/step" if cpu is not None else ""
    if cpu_by_kind is not None:
        cpu_ms += " (" + ", ".join(f"{kind} {seconds * 1000:.2f}" for kind, seconds in cpu_by_kind.items()) + ")"
    print(
        f"  {model:17s} acc {accumulate} {mode:3s} rep {rep}: {step * 1000:8.2f} ms/step{cpu_ms}  {shown}", flush=True
    )
    return {
        "mode": mode,
        "model": model,
        "accumulate": accumulate,
        "rep": rep,
        "step_s": step,
        # the job's CPU seconds per step, every process of it (launcher, lighthouse, agents, training processes)
        "job_cpu_per_step_s": cpu,
        # the same by kind of thread (job_cpu.THREAD_KINDS): training threads, torchft's, Gloo's, the rest
        "job_cpu_per_step_by_thread_s": cpu_by_kind,
        "loadavg_1m": load,
        "processes": processes,
        **critical,
    }


def to_next_forward(ends: list[float], forward_starts: list[float]) -> float | None:
    """The median time from each of ``ends`` to the first forward pass that starts after it (the last end has none):
    the critical path from a step's decision to the next step's first kernel."""
    gaps = []
    for end in ends:
        index = bisect.bisect_right(forward_starts, end)
        if index < len(forward_starts):
            gaps.append(forward_starts[index] - end)
    return median(gaps) if gaps else None


def summarise(runs_by_file: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (model, accumulation) over every file's runs: each repetition's ``ft`` ÷ ``ddp`` and the median."""
    pairs: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    cpu_ratios: dict[tuple[str, int], list[float]] = {}
    for name, runs in runs_by_file.items():
        by_rep: dict[tuple[str, int, int], dict[str, float]] = {}
        cpu_by_rep: dict[tuple[str, int, int], dict[str, float]] = {}
        for run in runs:
            by_rep.setdefault((run["model"], run["accumulate"], run["rep"]), {})[run["mode"]] = run["step_s"]
            if run.get("job_cpu_per_step_s"):  # runs before 2026-11-30 did not sample the job's CPU
                cpu_by_rep.setdefault((run["model"], run["accumulate"], run["rep"]), {})[run["mode"]] = run[
                    "job_cpu_per_step_s"
                ]
        for (model, accumulate, _), steps in sorted(by_rep.items()):
            if "ddp" in steps and "ft" in steps:
                pairs.setdefault((model, accumulate), []).append((steps["ddp"], steps["ft"], name))
        for (model, accumulate, _), cpus in sorted(cpu_by_rep.items()):
            if "ddp" in cpus and "ft" in cpus:
                cpu_ratios.setdefault((model, accumulate), []).append(cpus["ft"] / cpus["ddp"])
    rows = []
    for (model, accumulate), found in sorted(pairs.items(), key=lambda kv: (list(ZOO).index(kv[0][0]), kv[0][1])):
        ratios = [ft / ddp for ddp, ft, _ in found]
        ddp_ms = median([ddp * 1000 for ddp, _, _ in found])
        rows.append(
            {
                "model": model,
                "accumulate": accumulate,
                "parameters": parameter_count(model),
                "repetitions": len(found),
                "runs": len({name for _, _, name in found}),
                "ddp_ms": ddp_ms,
                "ft_ms": median([ft * 1000 for _, ft, _ in found]),
                "fixed_cost_ms": median([(ft - ddp) * 1000 for ddp, ft, _ in found]),
                "ratio_median": median(ratios),
                "ratio_worst": max(ratios),
                "ratios": [round(r, 3) for r in ratios],
                "goal": 1.02 if ddp_ms >= 100 else 1.05 if ddp_ms >= 10 else None,
                # the job's CPU seconds per step, ft ÷ ddp per repetition (repetitions that sampled it)
                "cpu_ratios": [round(r, 3) for r in cpu_ratios.get((model, accumulate), [])],
                "cpu_ratio_median": median(cpu_ratios[(model, accumulate)])
                if (model, accumulate) in cpu_ratios
                else None,
            }
        )
    return rows


def floor_split(runs_by_file: dict[str, list[dict[str, Any]]], floor_mode: str = "ddp_torchft") -> list[dict[str, Any]]:
    """Where ``ft``'s fixed cost over ``ddp`` lies, over every repetition that ran ``ddp``, ``floor_mode`` and ``ft``:
    torchft's protocol beside ``DDPStrategy`` with no lightning-ft code (``floor_mode - ddp``, :data:`FLOOR_MODES`)
    and lightning-ft above it (``ft - floor_mode``), in wall time and in the job's CPU per step (medians over
    repetitions, in ms)."""
    split: dict[tuple[str, int], dict[str, list[float]]] = {}
    for runs in runs_by_file.values():
        by_rep: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
        for run in runs:
            by_rep.setdefault((run["model"], run["accumulate"], run["rep"]), {})[run["mode"]] = run
        for (model, accumulate, _), modes in by_rep.items():
            if not {"ddp", floor_mode, "ft"} <= modes.keys():
                continue
            ddp, floor, ft = modes["ddp"], modes[floor_mode], modes["ft"]
            row = split.setdefault((model, accumulate), {})
            for key, field in (("wall", "step_s"), ("cpu", "job_cpu_per_step_s")):
                row.setdefault(f"floor_{key}_ms", []).append(1000 * (floor[field] - ddp[field]))
                row.setdefault(f"above_{key}_ms", []).append(1000 * (ft[field] - floor[field]))
                row.setdefault(f"ft_{key}_ms", []).append(1000 * (ft[field] - ddp[field]))
            for mode, run in (("floor", floor), ("ft", ft)):
                if "vote_ms" in run:
                    row.setdefault(f"{mode}_vote_ms", []).append(run["vote_ms"])
    return [
        {"model": model, "accumulate": accumulate, "repetitions": len(values["ft_wall_ms"])}
        | {key: round(median(found), 3) for key, found in values.items()}
        | {f"{key}_each": [round(v, 2) for v in found] for key, found in values.items() if key.endswith("wall_ms")}
        for (model, accumulate), values in sorted(split.items())
    ]


def floor_table(rows: list[dict[str, Any]], floor: str) -> str:
    lines = [
        "| model | accumulation | repetitions | `FTStrategy` − `DDPStrategy`, wall | of which " + floor + " | "
        "of which lightning-ft | the same in job CPU: all | torchft | lightning-ft | vote, torchft alone | vote, "
        "`FTStrategy` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['accumulate']} | {row['repetitions']} | {row['ft_wall_ms']:+.2f} ms | "
            f"{row['floor_wall_ms']:+.2f} ms | {row['above_wall_ms']:+.2f} ms | {row['ft_cpu_ms']:+.2f} ms | "
            f"{row['floor_cpu_ms']:+.2f} ms | {row['above_cpu_ms']:+.2f} ms | "
            f"{row.get('floor_vote_ms', math.nan):.2f} ms | {row.get('ft_vote_ms', math.nan):.2f} ms |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | parameters | accumulation | `DDPStrategy` step | `FTStrategy` step | fixed cost | ratio, median | "
        "ratio, worst | job CPU per step, ratio | repetitions | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        goal = row["goal"]
        verdict = "—" if goal is None else f"≤ {goal:.2f}×: {'met' if row['ratio_median'] <= goal else 'not met'}"
        cpu_ratio = row.get("cpu_ratio_median")
        cpu = "—" if cpu_ratio is None else f"{cpu_ratio:.3f}× ({len(row['cpu_ratios'])})"
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e6:.2f} M | {row['accumulate']} | {row['ddp_ms']:.1f} ms | "
            f"{row['ft_ms']:.1f} ms | {row['fixed_cost_ms']:+.1f} ms | {row['ratio_median']:.3f}× | "
            f"{row['ratio_worst']:.3f}× | {cpu} | {row['repetitions']} ({row['runs']} runs) | {verdict} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for accumulate, marker in ((1, "o"), (4, "s")):
        mine = [r for r in rows if r["accumulate"] == accumulate]
        for row in mine:
            axis.scatter([row["ddp_ms"]] * len(row["ratios"]), row["ratios"], marker=marker, color="0.75", s=12)
        axis.scatter(
            [r["ddp_ms"] for r in mine],
            [r["ratio_median"] for r in mine],
            marker=marker,
            label=f"median, accumulation {accumulate}",
        )
        for row in mine:
            axis.annotate(
                row["model"],
                (row["ddp_ms"], row["ratio_median"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.axhline(1.05, color="tab:red", linestyle="--", linewidth=0.8, label="goal at ≥ 10 ms: 1.05×")
    axis.axhline(1.02, color="tab:orange", linestyle=":", linewidth=0.8, label="goal at ≥ 100 ms: 1.02×")
    axis.set_xscale("log")
    axis.set_xlabel("DDPStrategy step time (ms, log scale)")
    axis.set_ylabel("FTStrategy ÷ DDPStrategy step time")
    axis.set_title("Step time over the zoo: every repetition (grey) and the median")
    axis.legend(fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def every_kept_run(results: Path = RESULTS) -> dict[str, list[dict[str, Any]]]:
    """Every kept run of 2 processes (those of another count are labelled ``<N>-process``, outside the verdict)."""
    return {
        path.name: json.loads(path.read_text())["runs"]
        for path in every("zoo", results)
        if not path.stem.endswith("-process")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--accumulate", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["ddp", "ft"],
        choices=MODES,
        help="ddp_torchft, ddp_quorum: DDPStrategy with torchft's quorum and vote, or its quorum alone, beside it; "
        "ddp_as_ft: DDPStrategy with the DDP settings FTStrategy gives DDP, ddp_as_ft_quorum with torchft's quorum "
        "too: the floors under ft (with ddp and ft, the summary also prints where ft's fixed cost lies)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=PROCESSES,
        help="processes per job (groups of 1, or the torchrun world); with 1 a core stays free for everything but "
        "training. Runs of another count than 2 are labelled <N>-process "
        "(results/zoo/<UTC>_<commit>_<N>-process.json), outside the verdict",
    )
    parser.add_argument("--out", type=Path, help="a new file (default: results/zoo/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--summary", action="store_true", help="only summarise every kept run and redraw the plot")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "zoo.png", help="where the plot goes")
    args = parser.parse_args()
    if not args.summary:
        label = args.label if args.processes == PROCESSES else f"{args.processes}-process"
        out = new_results_file("zoo", args.out, label)
        runs: list[dict[str, Any]] = []
        record = {**header(), "loadavg_start": list(os.getloadavg()), "runs": runs}
        with tempfile.TemporaryDirectory(prefix="lightning-ft-zoo-") as scratch_dir:
            scratch = Path(scratch_dir)
            for rep in range(args.repeats):
                for model, accumulate in itertools.product(args.models, args.accumulate):
                    modes = ["ddp", *(m for m in args.modes if m != "ddp")]
                    order = modes if rep % 2 == 0 else modes[::-1]
                    runs.extend(measure(m, model, accumulate, rep, scratch, args.processes) for m in order)
                    out.write_text(json.dumps({**record, "loadavg_end": list(os.getloadavg())}, indent=1))
        print(f"wrote {out}")
    if args.processes != PROCESSES:
        print(table(summarise({out.name: runs})))
        return
    kept = every_kept_run()
    rows = summarise(kept)
    if not rows:
        raise SystemExit(f"no zoo results under {RESULTS / 'zoo'}")
    print(table(rows))
    same_threads = {name: runs for name, runs in kept.items() if name not in UNEQUAL_THREAD_FLOOR_RUNS}
    for floor_mode, floor in FLOOR_MODES.items():
        floors = floor_split(same_threads, floor_mode)
        if floors:
            print(
                f"\nFTStrategy's fixed cost: {floor} (beside DDPStrategy, no lightning-ft code) and lightning-ft above"
            )
            print(floor_table(floors, floor))
    plot(rows, args.plot)


if __name__ == "__main__":
    main()

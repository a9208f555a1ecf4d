"""Draw ``docs/img/scale.png`` from every kept many-groups run (issue 26), each figure against N with its fit.

Reads every kept file under ``benchmarks/results/scale/`` (``scale.py``: step time and quorum wait at N real groups,
paired against a torchrun world of N), ``scale_kills/`` (``scale_kills.py``: the survivors' stall and the time until
every victim healed), ``lighthouse_scale/`` (``lighthouse_scale.py``: 10 to 1,000 simulated groups) and
``heal_fanout/`` (``heal_fanout.py``: k heals at once from one source or spread). Runs of ``scale.py`` with
``--probe-every`` add a validation run's and a logged metric's cost per N. Every run of every file is a point; the
line is the best of a constant, log N and N fitted to the medians per N (``scale.best_fit``). Usage::

    python -m benchmarks.scale.scale_plot                     # docs/img/scale.png
    python -m benchmarks.scale.scale_plot --out /tmp/scale.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common.results import every
from benchmarks.common.run_util import REPO, median
from benchmarks.scale.scale import best_fit


def load(section: str) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in every(section)]


def fitted(axis: Any, points: dict[int, list[float]], label: str, marker: str = "o") -> None:
    ns = sorted(points)
    for n in ns:
        axis.scatter([n] * len(points[n]), points[n], color="0.7", s=10, marker=marker)
    medians = [median(points[n]) for n in ns]
    axis.plot(ns, medians, marker=marker, linestyle="none", label=label)
    if len(ns) >= 2:
        fit = best_fit(ns, medians)
        g = {"constant": lambda n: 0.0, "log N": math.log, "N": float}[fit["best"]]
        xs = [ns[0] + (ns[-1] - ns[0]) * i / 50 for i in range(51)]
        axis.plot(xs, [fit["a"] + fit["b"] * g(x) for x in xs], linewidth=0.8, label=f"{label}: fit {fit['best']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "scale.png", help="where the plot goes")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 2, figsize=(11, 12))
    step, wait, ratio = {}, {}, {}
    for record in load("scale"):
        for run in record["runs"]:
            if run["mode"] == "ft":
                step.setdefault(run["groups"], []).append(run["step_s"] * 1000)
                wait.setdefault(run["groups"], []).append(run["quorum_wait_s"] * 1000)
        for row in record["rows"]:
            ratio.setdefault(row["groups"], []).extend(row["ratios"])
    baseline = {}
    for record in load("scale"):
        for run in record.get("runs", []):
            if run.get("mode") == "ddp":
                baseline.setdefault(run["groups"], []).append(run["step_s"] * 1000)
    axis = axes[0][0]
    fitted(axis, step, "FTStrategy step")
    fitted(axis, baseline, "DDPStrategy step (one torchrun world)", marker="s")
    fitted(axis, wait, "quorum wait per step", marker="^")
    axis.set(xlabel="replica groups N (1 process each, 2 cores)", ylabel="ms", title="Step time and quorum wait")
    axis.legend(fontsize=7)
    axis = axes[0][1]
    fitted(axis, ratio, "FTStrategy ÷ DDPStrategy, paired")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set(xlabel="replica groups N", ylabel="ratio", title="Step-time ratio")
    axis.legend(fontsize=7)

    stall, healed = {}, {}
    for record in load("scale_kills"):
        for round_ in record["rounds"]:
            key = round_["groups"]
            if round_["round"] == "quarter":
                stall.setdefault(key, []).append(round_["survivor_stall_s"])
                healed.setdefault(key, []).append(round_["all_healed_after_s"])
    axis = axes[1][0]
    if stall:
        fitted(axis, stall, "survivors' longest stall")
        fitted(axis, healed, "kill → every victim healed", marker="s")
    axis.set(xlabel="replica groups N (a quarter killed at once)", ylabel="s", title="A quarter of the groups killed")
    axis.legend(fontsize=7)

    formation, fan_out, drop, cpu = {}, {}, {}, {}
    for record in load("lighthouse_scale"):
        for run in record["runs"]:
            formation.setdefault(run["groups"], []).append(run["formation_s"] * 1000)
            fan_out.setdefault(run["groups"], []).append(run["fan_out_s"] * 1000)
            drop.setdefault(run["groups"], []).append(run["drop_s"] * 1000)
            cpu.setdefault(run["groups"], []).append(run["lighthouse_cpu_us_per_heartbeat"])
    axis = axes[1][1]
    fitted(axis, formation, "quorum formation (ms)")
    fitted(axis, drop, "drop a quarter (ms)", marker="s")
    fitted(axis, cpu, "lighthouse CPU per heartbeat (µs)", marker="^")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set(xlabel="simulated groups N", title="The lighthouse, 10 to 1,000 simulated groups")
    axis.legend(fontsize=7)
    probes: dict[str, dict[int, list[float]]] = {}
    for record in load("scale"):
        for run in record.get("runs", []):
            for key in ("probe_in_step_s", "probe_validation_s"):
                if key in run and "mode" in run:
                    probes.setdefault(f"{run['mode']} {key}", {}).setdefault(run["groups"], []).append(run[key] * 1000)
    axis = axes[2][0]
    for key, label, marker in (
        ("ft probe_validation_s", "FTStrategy validation run (a sync section)", "o"),
        ("ddp probe_validation_s", "DDPStrategy validation run", "s"),
        ("ft probe_in_step_s", "FTStrategy sync_dist in the step", "^"),
        ("ddp probe_in_step_s", "DDPStrategy sync_dist in the step", "v"),
    ):
        if key in probes:
            fitted(axis, probes[key], label, marker=marker)
    axis.set(xlabel="replica groups N", ylabel="ms", title="Job-wide reductions: a validation run, a logged metric")
    axis.legend(fontsize=7)

    heals: dict[str, dict[int, list[float]]] = {}
    for record in load("heal_fanout"):
        for row in record["rows"]:
            lone = row["k"] == 1  # a lone heal starts both series
            labels = ["from one source"] if row["layout"] == "one" else []
            labels += ["each from its own source"] if row["layout"] == "spread" or lone else []
            for label in labels:
                heals.setdefault(label, {}).setdefault(row["k"], []).extend(s * 1000 for s in row["all_healed_s"][1:])
    axis = axes[2][1]
    for (label, points), marker in zip(heals.items(), ("o", "s"), strict=False):
        fitted(axis, points, label, marker=marker)
    axis.set(xlabel="heals at once k (100 MB each)", ylabel="ms until the last heal returned")
    axis.set(title="Heal fan-out (first, cold repetition left out)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

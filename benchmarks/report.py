"""Every performance figure of issue 7 against its target, as one table and one picture.

Reads what the benchmarks wrote under ``benchmarks/results/`` (``overhead.json``, ``goodput.json``,
``heal_throughput.json``) and writes ``benchmarks/results/performance.md`` (the tables that ``docs/benchmarks.md``
quotes) and ``docs/img/performance.png``. A benchmark that has not been run is reported as missing, not guessed.
``make bench`` runs it last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from run_util import REPO, RESULTS

# (figure, target, comparison): the targets of issue 7.
OVERHEAD_TARGETS = {"1m": 1.10, "50m": 1.02}
SURVIVOR_TARGET_S = 1.2
HEAL_TARGET_GBPS = 1.0
GOODPUT_TARGET = 0.97
ABSOLUTE_TARGET = 1.05


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def summary_rows(overhead: Any, goodput: Any, heal: Any) -> list[str]:
    rows = ["| figure | measured | target | |", "|---|---:|---:|---|"]
    if overhead:
        for row in overhead["rows"]:
            if row["mode"] == "ft":
                target = OVERHEAD_TARGETS[row["size"]]
                paired = row.get("paired_ratio_median")  # absent from results written before it was reported
                measured = f"{row['ratio_vs_ddp']:.3f}×" + (f" (paired: {paired:.3f}×)" if paired is not None else "")
                met = row["ratio_vs_ddp"] <= target and (paired is None or paired <= target)
                rows.append(
                    f"| step time, FTStrategy / DDPStrategy, {row['size'].upper()} parameters "
                    f"({row['step_ms']:.1f} ms per step) | {measured} | ≤ {target:.2f}× | {verdict(met)} |"
                )
        for row in overhead["rows"]:
            like_for_like = _like_for_like_ratio(overhead, row) if row["mode"] == "ft" else None
            if like_for_like is not None:
                rows.append(
                    f"| step time, FTStrategy / DDPStrategy(gradient_as_bucket_view=True), {row['size'].upper()} "
                    f"parameters: what fault tolerance alone costs | {like_for_like:.3f}× | (reported) | |"
                )
        for row in overhead["rows"]:
            if row["mode"] == "ft":
                rows.append(
                    f"| peak RSS per process, FTStrategy / DDPStrategy, {row['size'].upper()} "
                    f"| {row['rss_ratio_vs_ddp']:.2f}× | (reported) | |"
                )
    if goodput:
        summary = goodput["summary"]
        recovery = summary["ft_recovery_median"]
        stall = recovery.get("kill_to_survivors_commit_s")
        if stall is not None:
            rows.append(
                f"| kill → survivors commit again (median) | {stall:.2f} s | ≤ {SURVIVOR_TARGET_S} s "
                f"| {verdict(stall <= SURVIVOR_TARGET_S)} |"
            )
        ft = summary["ft"]
        rows.append(
            f"| goodput with a kill every {goodput['settings']['kill_every_s']:.0f} s, committed steps | "
            f"{ft['goodput_steps']:.3f} | ≥ {GOODPUT_TARGET} | {verdict(ft['goodput_steps'] >= GOODPUT_TARGET)} |"
        )
        rows.append(f"| goodput, committed samples | {ft['goodput_samples']:.3f} | (reported) | |")
        if "absolute_vs_best_restart" in ft:
            ratio = ft["absolute_vs_best_restart"]
            rows.append(
                f"| absolute progress, lightning-ft ÷ best restart baseline | {ratio:.2f}× | ≥ {ABSOLUTE_TARGET}× "
                f"| {verdict(ratio >= ABSOLUTE_TARGET)} |"
            )
    if heal:
        for row in heal["rows"]:
            rows.append(
                f"| heal throughput, {row['transport']}, {row['size_bytes'] / 1e6:.0f} MB | {row['gb_per_s']:.2f} GB/s "
                f"| ≥ {HEAL_TARGET_GBPS} GB/s | {verdict(row['gb_per_s'] >= HEAL_TARGET_GBPS)} |"
            )
    return rows


def _like_for_like_ratio(overhead: Any, ft_row: dict[str, Any]) -> float | None:
    """``ft`` ÷ ``ddp_view`` (DDPStrategy with FTStrategy's default ``gradient_as_bucket_view=True``) at the size of
    ``ft_row``, by medians of runs; ``None`` where ``ddp_view`` was not measured (``overhead.py --modes``)."""
    view = [r for r in overhead["rows"] if r["size"] == ft_row["size"] and r["mode"] == "ddp_view"]
    return ft_row["step_ms"] / view[0]["step_ms"] if view else None


def overhead_table(overhead: Any) -> list[str]:
    rows = [
        "| size | mode | step (median of runs) | × DDPStrategy | paired × (median) | runs (ms) | peak RSS "
        "| × DDPStrategy |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for row in overhead["rows"]:
        paired = row.get("paired_ratio_median")
        rows.append(
            f"| {row['size']} | {row['mode']} | {row['step_ms']:.2f} ms | {row['ratio_vs_ddp']:.3f} "
            f"| {'' if paired is None else f'{paired:.3f}'} "
            f"| {', '.join(f'{v:.1f}' for v in row['per_rep_ms'])} | {row['peak_rss_mib']:.0f} MiB "
            f"| {row['rss_ratio_vs_ddp']:.2f} |"
        )
    return rows


def goodput_table(goodput: Any) -> list[str]:
    summary = goodput["summary"]
    configs = [c for c in summary if not c.endswith("_median") and c != "model_inputs"]
    rows = [
        "| side | failure-free steps | goodput (steps) | goodput (samples) | absolute progress (÷ baseline's "
        "failure-free steps) |",
        "|---|---:|---:|---:|---:|",
    ]
    for config in configs:
        s = summary[config]
        rows.append(
            f"| {config} | {s['failure_free_steps']:.0f} | {s['goodput_steps']:.3f} | {s['goodput_samples']:.3f} "
            f"| {s['absolute_progress']:.3f} |"
        )
    return rows


def recovery_table(goodput: Any) -> list[str]:
    rec = goodput["summary"]["ft_recovery_median"]
    names = [
        ("kill_to_survivors_commit_s", "kill → survivors commit again"),
        ("kill_to_restarted_commit_s", "kill → restarted group commits"),
        ("respawn_s", "of which: torchrun notices and respawns"),
        ("import_s", "of which: imports (torch, Lightning, torchft)"),
        ("setup_s", "of which: setup (Trainer, Manager, quorum join)"),
        ("first_step_s", "of which: first step (quorum, heal, commit)"),
        ("heal_s", "of that: heal (receive + apply)"),
    ]
    rows = ["| lightning-ft, per kill (median) | seconds |", "|---|---:|"]
    rows += [f"| {label} | {rec[key]:.2f} |" for key, label in names if key in rec]
    for config, values in goodput["summary"].items():
        if config.endswith("_recovery_median") and not config.startswith("ft"):
            name = config.removesuffix("_recovery_median")
            for key, value in values.items():
                unit = "" if key == "lost_steps" else " s"
                rows.append(f"| {name}: {key.removesuffix('_s').replace('_', ' ')} | {value:.2f}{unit} |")
    return rows


def plot(path: Path, overhead: Any, goodput: Any, heal: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    if overhead:
        sizes = sorted({r["size"] for r in overhead["rows"]}, key=lambda s: int(s[:-1]))
        modes = [m for m in ("ddp_view", "ft", "torchft") if any(r["mode"] == m for r in overhead["rows"])]
        width = 0.8 / len(modes)
        for k, mode in enumerate(modes):
            values = [
                next(r["ratio_vs_ddp"] for r in overhead["rows"] if r["size"] == s and r["mode"] == mode) for s in sizes
            ]
            offset = -0.4 + width * (k + 0.5)
            ax.bar([i + offset for i in range(len(sizes))], values, width=width, label=f"{mode} / DDPStrategy")
        for i, size in enumerate(sizes):
            ax.hlines(OVERHEAD_TARGETS[size], i - 0.45, i + 0.45, colors="k", linestyles="--")
        ax.set_xticks(range(len(sizes)), [f"{s.upper()} params" for s in sizes])
        ax.set_ylim(0.9, max(1.4, ax.get_ylim()[1]))
        ax.legend()
    ax.set_title("Step time against DDPStrategy (dashed: target)")
    ax = axes[0][1]
    if goodput:
        rec = goodput["summary"]["ft_recovery_median"]
        parts = ["respawn_s", "import_s", "setup_s", "first_step_s"]
        left = 0.0
        for part in parts:
            if part in rec:
                ax.barh(1, rec[part], left=left, label=part.removesuffix("_s"))
                left += rec[part]
        ax.barh(0, rec.get("kill_to_survivors_commit_s", 0), color="tab:gray", label="survivors stall")
        ax.axvline(SURVIVOR_TARGET_S, color="k", linestyle="--")
        ax.set_yticks([0, 1], ["survivors", "killed group"])
        ax.set_xlabel("seconds after the kill")
        ax.legend(fontsize=8)
    ax.set_title("Recovery per kill (median)")
    ax = axes[1][0]
    if heal:
        labels = [f"{r['transport']}\n{r['size_bytes'] / 1e9:g} GB" for r in heal["rows"]]
        ax.bar(range(len(labels)), [r["gb_per_s"] for r in heal["rows"]])
        ax.axhline(HEAL_TARGET_GBPS, color="k", linestyle="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("GB/s")
    ax.set_title("Heal throughput on loopback (dashed: target)")
    ax = axes[1][1]
    if goodput:
        summary = goodput["summary"]
        configs = [c for c in summary if not c.endswith("_median") and c != "model_inputs"]
        ax.bar(
            [i - 0.2 for i in range(len(configs))], [summary[c]["goodput_steps"] for c in configs], 0.4, label="goodput"
        )
        ax.bar(
            [i + 0.2 for i in range(len(configs))],
            [summary[c]["absolute_progress"] for c in configs],
            0.4,
            label="absolute progress",
        )
        ax.axhline(GOODPUT_TARGET, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(configs)), configs)
        ax.set_ylim(0, 1.1)
        ax.legend()
    ax.set_title("Under a kill every 30 s (3 workers)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-md", type=Path, default=RESULTS / "performance.md")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "img" / "performance.png")
    args = parser.parse_args()
    overhead, goodput, heal = load("overhead.json"), load("goodput.json"), load("heal_throughput.json")
    lines = ["## Against the targets", "", *summary_rows(overhead, goodput, heal), ""]
    missing = [n for n, d in (("overhead", overhead), ("goodput", goodput), ("heal_throughput", heal)) if d is None]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    if overhead:
        lines += ["## Step time and memory", "", *overhead_table(overhead), ""]
    if goodput:
        lines += ["## Goodput", "", *goodput_table(goodput), "", "## Recovery", "", *recovery_table(goodput), ""]
    args.out_md.write_text("\n".join(lines))
    plot(args.out_png, overhead, goodput, heal)
    print("\n".join(lines))
    print(f"wrote {args.out_md} and {args.out_png}")


if __name__ == "__main__":
    main()

"""A first-order analytic model of goodput at cluster scale: whole-job restart (A) against per-step fault tolerance (B).

Both approaches run the same hardware: G replica groups (for A, one DDP job spanning G groups' worth of nodes).
Failures hit the job as a Poisson process; with a per-group MTBF m the job-level MTBF is M = m / G. Goodput is the
fraction of wall time that turns into training progress, relative to a failure-free DDP job on that hardware.

* A, ``torchrun --max-restarts`` from a periodic checkpoint: every failure stops the whole job for R_A (detection,
  process restart, imports, rendezvous, checkpoint load) and loses on average I / 2 of work since the last checkpoint
  (interval I seconds); each checkpoint blocks training for c_ckpt::

      goodput_A = max(0, (1 - c_ckpt / I) * (1 - (R_A + I / 2) / M))

  By default A gets its best interval, Young/Daly I* = sqrt(2 * c_ckpt * M) (``--ckpt-interval`` fixes one).
* B, lightning-ft: a failure stalls every survivor for D (heartbeat timeout plus the step that did not commit), and
  the failed group, 1/G of the job, is out for R_B (restart plus heal from a live peer) while the others train on.
  Every step costs a constant factor o (step time of FTStrategy / DDP)::

      goodput_B (relative to failure-free B) = max(0, 1 - (D + R_B / G) / M);   progress_B = goodput_B / o

The break-even MTBF is the one at which progress_B equals goodput_A; at lower MTBF, B is ahead.

Assumptions and limits: failures are independent, one at a time (no overlap, no failure during a restart or heal)
and never take out all groups; first order in 1/M, so numbers near 0 are qualitative. B's own rare checkpoints (for
whole-job loss) are neglected, and so are the survivors' smaller global batch while a group is out and any
straggler effects. The "measured" costs come from 2 processes on small machines: ``report.cluster_inputs`` takes
them over every kept run under ``benchmarks/results/overhead/`` and ``goodput/``, from the same runs and functions
as ``report.py``'s verdicts (R_A, D, R_B and this machine's o from the goodput runs, every kill and repetition; the
at-scale o is the 50M step-time verdict), so that the model and the verdict table cannot disagree; a cost that no run
holds takes the default below. No run measures the baseline's checkpoint write, c_ckpt: it is assumed. The "at
scale" costs are assumptions for illustration, not measurements: a full-job restart of minutes, a longer stall and
heal (NCCL timeouts and init, weights and optimizer state pulled from a peer), a slower checkpoint write.

A second table extends the simulated-groups measurement (``scale/lighthouse_scale.py``, every kept file under
``benchmarks/results/lighthouse_scale/``: the lighthouse's CPU per heartbeat and a quorum's formation time per group)
over G groups, with the cross-group ring's latency at an assumed hop latency: where one lighthouse or the allreduce
becomes the limit (:func:`limits_table`).

    python -m benchmarks.performance.cluster_model    # docs/img/cluster-model.png, results/cluster_model/latest.md
    python -m benchmarks.performance.cluster_model --ckpt-interval 1800 --out-png /tmp/m.png --out-md /tmp/m.md
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.common.results import RESULTS, every
from benchmarks.common.run_util import REPO
from benchmarks.performance.report import cluster_inputs

HOUR, DAY, WEEK = 3600.0, 86400.0, 604800.0
MEASURED = ("r_a", "d", "r_b", "c_ckpt")  # the per-failure costs of this machine's rows; o is reported apart


@dataclass(frozen=True)
class Costs:
    r_a: float = 8.0  # A: detection + restart + imports + checkpoint load, s
    d: float = 1.1  # B: stall of the survivors per failure, s
    r_b: float = 5.0  # B: restart + heal of the failed group, s
    o: float = 1.05  # B: step time ratio to DDP
    c_ckpt: float = 0.5  # A: blocking checkpoint write, s


def load_measured(results: Path) -> tuple[Costs, float, list[str]]:
    """This machine's costs (o: the goodput runs' step-time ratio) and the at-scale o, from ``report.cluster_inputs``
    where the kept runs hold them, defaults otherwise; the notes say which is which."""
    inputs, notes = cluster_inputs(results), []
    values = {}
    for name in (*MEASURED, "o"):
        if name in inputs:
            values[name] = inputs[name].value
            value = f"{inputs[name].value:.3f}" if name == "o" else f"{inputs[name].value:.3g} s"
            notes.append(f"{name} = {value} ({inputs[name].source})")
        else:
            notes.append(f"{name}: no kept run measures it, default {getattr(Costs(), name):g}")
    if "o_scale" in inputs:
        o_scale = inputs["o_scale"].value
        notes.append(f"o at scale = {o_scale:.3f} ({inputs['o_scale'].source})")
    else:
        o_scale = Costs().o
        notes.append(f"o at scale: no kept step-time run at 50M, default {o_scale:g}")
    return Costs(**values), o_scale, notes


def young_daly(c_ckpt: float, m_job: float) -> float:
    return math.sqrt(2 * c_ckpt * m_job)


def goodput_a(c: Costs, m_job: float, interval: float | None = None) -> float:
    i = young_daly(c.c_ckpt, m_job) if interval is None else interval
    return max(0.0, (1 - c.c_ckpt / i) * (1 - (c.r_a + i / 2) / m_job))


def progress_b(c: Costs, m_job: float, groups: int) -> float:
    return max(0.0, 1 - (c.d + c.r_b / groups) / m_job) / c.o


def break_even(c: Costs, groups: int, interval: float | None = None) -> float:
    """The largest job MTBF (s) at which B's progress equals A's goodput; inf if B leads at every MTBF, 0 if never."""
    grid = np.logspace(0, 10, 2001)
    ahead = [progress_b(c, m, groups) > goodput_a(c, m, interval) for m in grid]
    if ahead[-1]:
        return math.inf
    if not any(ahead):
        return 0.0
    k = max(i for i, a in enumerate(ahead) if a)
    lo, hi = float(grid[k]), float(grid[k + 1])
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if progress_b(c, mid, groups) > goodput_a(c, mid, interval) else (lo, mid)
    return lo


def human(seconds: float) -> str:
    if math.isinf(seconds):
        return "∞"
    for unit, size in (("d", DAY), ("h", HOUR), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def source_of(notes: list[str]) -> str:
    """How this machine's costs were obtained: measured, except the fields the results files do not hold."""
    assumed = [name for name in MEASURED if not any(note.startswith(f"{name} = ") for note in notes)]
    return "measured costs" + (f"; {', '.join(assumed)} assumed" if assumed else "")


def scenarios(measured: Costs, scale: Costs, source: str) -> list[tuple[str, int, float, Costs]]:
    return [
        (f"this machine ({source}), 1 failure / group / h", 2, HOUR, measured),
        (f"this machine ({source}), 1 failure / group / day", 2, DAY, measured),
        ("64 groups, group MTBF 1 week, R_A 60 s", 64, WEEK, replace(scale, r_a=60.0)),
        ("64 groups, group MTBF 1 week, R_A 300 s", 64, WEEK, scale),
        ("1024 groups, group MTBF 1 week, R_A 300 s", 1024, WEEK, scale),
        ("1024 groups, group MTBF 4 weeks, R_A 300 s", 1024, 4 * WEEK, scale),
    ]


def table(rows: list[tuple[str, int, float, Costs]], interval: float | None) -> str:
    head = ["scenario", "G", "job MTBF", "R_A", "c_ckpt", "I (A)", "D", "R_B", "o", "goodput A", "progress B", "B / A"]
    lines = ["| " + " | ".join([*head, "break-even job MTBF"]) + " |", "|---|" + "---:|" * 12]
    for name, groups, m_group, c in rows:
        m = m_group / groups
        a, b = goodput_a(c, m, interval), progress_b(c, m, groups)
        i = young_daly(c.c_ckpt, m) if interval is None else interval
        cells = [name, str(groups), human(m), human(c.r_a), human(c.c_ckpt), human(i), human(c.d), human(c.r_b)]
        ratio = f"{b / a:.2f}" if a > 0 else "∞"
        cells += [f"{c.o:.3f}", f"{a:.3f}", f"{b:.3f}", ratio, human(break_even(c, groups, interval))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, measured: Costs, scale: Costs, interval: float | None, c_assumed: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    c_source = "assumed" if c_assumed else "measured"
    fig, ax = plt.subplots(2, 2, figsize=(13, 9.5))
    m_job = np.logspace(np.log10(180), np.log10(30 * DAY), 300)
    a_lines = [
        (f"A, R_A {measured.r_a:.3g} s (measured), c {measured.c_ckpt:g} s ({c_source})", measured, "C0"),
        ("A, R_A 60 s", replace(scale, r_a=60.0), "C1"),
        (f"A, R_A {scale.r_a:g} s", scale, "C3"),
    ]
    b_lines = [("B, G 2 (measured)", measured, 2, "C0"), ("B, G 64", scale, 64, "C2"), ("B, G 1024", scale, 1024, "C4")]
    for label, c, color in a_lines:
        ax[0, 0].plot(m_job / HOUR, [goodput_a(c, m, interval) for m in m_job], color=color, label=label)
    for label, c, groups, color in b_lines:
        ax[0, 0].plot(m_job / HOUR, [progress_b(c, m, groups) for m in m_job], "--", color=color, label=label)
    ax[0, 0].set(xscale="log", xlabel="job MTBF M (h)", ylabel="progress vs failure-free DDP", ylim=(0, 1.02))
    ax[0, 0].set_title("Goodput vs job MTBF (A at its Young/Daly interval)")

    r_a = np.logspace(0.5, 3.3, 120)
    for o, color in ((1.01, "C2"), (measured.o, "C0"), (1.10, "C3")):
        ends = [break_even(replace(scale, r_a=r, o=o), 64, interval) for r in r_a]
        ax[0, 1].plot(r_a, np.array(ends) / HOUR, color=color, label=f"o {o:.3g}" + " (measured)" * (o == measured.o))
    ax[0, 1].set(xscale="log", yscale="log", xlabel="A's restart time R_A (s)", ylabel="break-even job MTBF (h)")
    ax[0, 1].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax[0, 1].set_title("Break-even, G 64 (G barely matters): B ahead below the line")

    groups_axis = np.unique(np.logspace(0, np.log10(16384), 60).astype(int))
    for label, c, color in a_lines[1:]:
        ax[1, 0].plot(groups_axis, [goodput_a(c, WEEK / g, interval) for g in groups_axis], color=color, label=label)
    ax[1, 0].plot(groups_axis, [progress_b(scale, WEEK / g, g) for g in groups_axis], "--", color="C2", label="B")
    ax[1, 0].set(xscale="log", xlabel="replica groups G (group MTBF 1 week)", ylabel="progress vs failure-free DDP")
    ax[1, 0].set(ylim=(0, 1.02), title="Goodput vs scale")

    m64 = WEEK / 64
    intervals = np.logspace(1, 4.5, 200)
    for label, c, color in a_lines[1:]:
        ax[1, 1].plot(intervals / 60, [goodput_a(c, m64, i) for i in intervals], color=color, label=label)
        best = young_daly(c.c_ckpt, m64)
        ax[1, 1].plot(best / 60, goodput_a(c, m64, best), "o", color=color)
    ax[1, 1].axhline(progress_b(scale, m64, 64), ls="--", color="C2", label="B, G 64")
    ax[1, 1].set(xscale="log", xlabel="A's checkpoint interval I (min); dots: Young/Daly I*", ylim=(0.5, 1.0))
    ax[1, 1].set(ylabel="progress vs failure-free DDP", title=f"Checkpoint interval, G 64, job MTBF {human(m64)}")
    for a in ax.flat:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(
        f"Whole-job restart (A, solid) vs lightning-ft (B, dashed). Measured: R_A {measured.r_a:.3g} s, "
        f"c {measured.c_ckpt:g} s ({c_source}), D {measured.d:.3g} s, R_B {measured.r_b:.3g} s, o {measured.o:.3f};\n"
        f"at scale: o {scale.o:.3f} (measured, 50M); assumed c {scale.c_ckpt:g} s, D {scale.d:g} s, "
        f"R_B {scale.r_b:g} s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


HEARTBEAT_INTERVAL_S = 0.1  # torchft's default heartbeat interval (the ManagerServer's)
RING_HOP_LATENCY_S = 50e-6  # assumed: one message hop of a cross-group ring over a datacenter network, not measured


def lighthouse_inputs(results: Path) -> dict[str, float] | None:
    """The simulated-groups measurement (``lighthouse_scale.py``) at its largest N, over every kept file: the
    lighthouse's CPU per heartbeat (the least over files: the cost with the driver not starving it) and a quorum's
    formation time per group (the most: an upper bound, driver-bound at the top)."""
    runs = []
    for path in every("lighthouse_scale", results):
        runs += json.loads(path.read_text())["runs"]
    if not runs:
        return None
    top = max(run["groups"] for run in runs)
    largest = [run for run in runs if run["groups"] == top]
    return {
        "groups": float(top),
        "cpu_s_per_heartbeat": min(run["lighthouse_cpu_us_per_heartbeat"] for run in largest) * 1e-6,
        "formation_s_per_group": max(run["formation_s"] for run in largest) / top,
        "drop_s": max(run["drop_s"] for run in largest),
    }


def limits_table(inputs: dict[str, float], groups: tuple[int, ...] = (16, 64, 256, 1024, 4096)) -> str:
    """What grows with G for one lighthouse and one cross-group ring, from the measured per-member costs.

    * heartbeats: G groups each heartbeat every 100 ms, each costing the lighthouse ``cpu_s_per_heartbeat`` of one
      core; past a share of 1 the lighthouse falls behind and healthy groups look dead;
    * quorum formation: one quorum RPC per group per step, linear in G at the measured per-group cost (an upper bound:
      at 1,000 groups the measuring driver, not the lighthouse, was short of CPU); with ``use_async_quorum`` it
      overlaps the step, so it costs nothing while the step is longer;
    * the cross-group ring (Gloo's allreduce, as in this project's CPU runs): 2 (G - 1) message hops per bucket, so
      its latency term grows with G at an assumed hop latency; its bytes per group stay 2 (G - 1) / G of the
      gradients. NCCL's tree and PAT algorithms grow as log G instead.
    """
    per_beat, per_group = inputs["cpu_s_per_heartbeat"], inputs["formation_s_per_group"]
    lines = [
        "| G | lighthouse heartbeat load (share of one core) | quorum formation (shortest step that hides it) "
        f"| ring latency per bucket (hop {RING_HOP_LATENCY_S * 1e6:.0f} µs, assumed) |",
        "|---:|---:|---:|---:|",
    ]
    for g in groups:
        load = g / HEARTBEAT_INTERVAL_S * per_beat
        lines.append(f"| {g} | {load:.2f} | {human(g * per_group)} | {human(2 * (g - 1) * RING_HOP_LATENCY_S)} |")
    limit = 1.0 / (per_beat / HEARTBEAT_INTERVAL_S)
    lines += [
        "",
        f"Measured at {inputs['groups']:.0f} simulated groups: {per_beat * 1e6:.0f} µs of lighthouse CPU per "
        f"heartbeat, {per_group * 1e3:.2f} ms of quorum formation per group, a quarter dropped in "
        f"{human(inputs['drop_s'])}. One lighthouse core serves about {limit:,.0f} groups at a heartbeat every "
        f"{HEARTBEAT_INTERVAL_S * 1e3:.0f} ms.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of the sections' results folders")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "img" / "cluster-model.png")
    parser.add_argument("--out-md", type=Path, default=RESULTS / "cluster_model" / "latest.md")
    parser.add_argument("--ckpt-interval", type=float, default=None, help="A's interval in s (default: Young/Daly)")
    parser.add_argument("--scale-restart", type=float, default=300.0, help="at-scale R_A, s")
    parser.add_argument("--scale-ckpt", type=float, default=10.0, help="at-scale c_ckpt, s")
    parser.add_argument("--scale-stall", type=float, default=10.0, help="at-scale D, s")
    parser.add_argument("--scale-heal", type=float, default=60.0, help="at-scale R_B, s")
    args = parser.parse_args()
    measured, o_scale, notes = load_measured(args.results)
    scale = replace(
        measured, r_a=args.scale_restart, c_ckpt=args.scale_ckpt, d=args.scale_stall, r_b=args.scale_heal, o=o_scale
    )
    source = source_of(notes)
    md = table(scenarios(measured, scale, source), args.ckpt_interval)
    text = "\n".join(["Inputs: " + "; ".join(notes) + ".", "", md, ""])
    lighthouse = lighthouse_inputs(args.results)
    if lighthouse is not None:
        text += "\n".join(["", "What grows with the number of groups G:", "", limits_table(lighthouse), ""])
    print(text)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(text)
    plot(args.out_png, measured, scale, args.ckpt_interval, c_assumed="c_ckpt assumed" in source)
    print(f"wrote {args.out_md} and {args.out_png}")


if __name__ == "__main__":
    main()

"""Semi-synchronous benchmark (issue 4): bytes between replica groups per inner step, and held-out loss after a fixed
number of inner steps, for ``ddp``, ``local_sgd`` and ``diloco`` at several ``sync_every`` values.

Each configuration is a real job: ``lightning-ft launch`` starts a lighthouse and 2 replica groups of 1 process
(``semi_sync_worker.py``), which train a small byte-level transformer (``benchmarks/common/tiny_lm.py``) with
``FTStrategy`` to ``--steps`` inner steps. Configurations run one after another. Afterwards this script checks that
both groups ended with bit-identical parameters and evaluates the held-out loss of the final model.

By default each job runs in a private network namespace (``unshare --net``, needs root or user namespaces) whose
only interface is ``lo``, so its loopback byte counters count exactly that job's traffic (both groups and the
lighthouse). Without one (``--no-netns``, or where ``unshare`` fails) the counters are machine-wide.

    python -m benchmarks.semi_sync.semi_sync                 # every configuration, seed 0 (about 15 minutes, 2 cores)
    python -m benchmarks.semi_sync.semi_sync --seeds 0 1     # two seeds
    python -m benchmarks.semi_sync.semi_sync --configs ddp diloco:32 --steps 96      # a quick look
    python -m benchmarks.semi_sync.semi_sync --report-only   # table and plot from the newest results file

Each run writes a new file, ``benchmarks/results/semi_sync/<UTC>_<commit>.json`` (unless ``--results`` names one),
and the table of the file it reports to ``benchmarks/results/semi_sync/latest.md``.

Configuration names: ``ddp``, ``local_sgd:H``, ``diloco:H``, ``diloco:HxK`` (streaming DiLoCo, K fragments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.results import RESULTS, header, new_results_file, newest
from benchmarks.common.run_util import REPO, repo_env
from benchmarks.common.tiny_lm import CONTEXT, TinyLM, corpus_digest, held_out_loss, load_corpus, parameter_count
from lightning_ft_job.events import read_events

WORKER = Path(__file__).with_name("semi_sync_worker.py")
SECTION = "semi_sync"
GROUPS = 2
DEFAULT_CONFIGS = (
    "ddp",
    "local_sgd:8",
    "local_sgd:32",
    "local_sgd:96",
    "diloco:8",
    "diloco:32",
    "diloco:96",
    "diloco:32x2",
)
STOP_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Config:
    algorithm: str
    sync_every: int | None = None
    fragments: int | None = None

    @property
    def name(self) -> str:
        if self.algorithm == "ddp":
            return "ddp"
        suffix = f"x{self.fragments}" if self.fragments else ""
        return f"{self.algorithm}:{self.sync_every}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Config:
        algorithm, _, rest = text.partition(":")
        if algorithm == "ddp" and not rest:
            return cls("ddp")
        if algorithm not in ("local_sgd", "diloco") or not rest:
            raise argparse.ArgumentTypeError(f"{text!r}: expected ddp, local_sgd:H, diloco:H or diloco:HxK")
        every, _, fragments = rest.partition("x")
        if fragments and algorithm != "diloco":
            raise argparse.ArgumentTypeError(f"{text!r}: fragments (xK) are a DiLoCo setting")
        return cls(algorithm, int(every), int(fragments) if fragments else None)

    def worker_args(self) -> list[str]:
        args = [f"--algorithm={self.algorithm}"]
        if self.sync_every is not None:
            args.append(f"--sync-every={self.sync_every}")
        if self.fragments is not None:
            args.append(f"--fragments={self.fragments}")
        return args


# ---------------------------------------------------------------------------------------------------- running jobs
def netns_available() -> bool:
    """Whether ``unshare --net`` works here and the hostname resolves to loopback (torchft's HTTP checkpoint
    transport advertises ``socket.gethostname()``, which must be reachable inside a namespace with only ``lo``)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        if not socket.gethostbyname(socket.gethostname()).startswith("127."):
            return False
        probe = subprocess.run(
            ["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def launch_command(config: Config, steps: int, seed: int, batch_size: int, lr: float, out_dir: Path) -> list[str]:
    """``lightning-ft launch`` with a lighthouse that needs both groups, no restarts (a failure is a failure)."""
    return [
        sys.executable,
        "-m",
        "lightning_ft_cli",
        "launch",
        f"--replica-groups={GROUPS}",
        "--nproc-per-group=1",
        "--max-restarts=0",
        f"--min-replicas={GROUPS}",
        f"--events-dir={out_dir / 'events'}",
        "--",
        "python",
        str(WORKER),
        *config.worker_args(),
        f"--max-steps={steps}",
        f"--batch-size={batch_size}",
        f"--lr={lr}",
        f"--seed={seed}",
        f"--out-dir={out_dir}",
    ]


def run_job(command: list[str], log_path: Path, timeout: float, netns: bool) -> None:
    """Run the launcher (in a fresh network namespace with ``lo`` up, if asked) and wait for it; on timeout or
    interruption, stop it by PID: SIGTERM (it stops the groups it started), then SIGKILL of its session."""
    if netns:
        # unshare and sh exec into the launcher, so the PID we hold is the launcher's.
        command = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    env = repo_env()
    env["OMP_NUM_THREADS"] = "1"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except BaseException:  # a timeout, or Ctrl-C here
            _stop(process)
            raise
    if returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"job failed (exit code {returncode}); last lines of {log_path}:\n{tail}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session we created for it: its id is the launcher's PID
        process.wait(timeout=10)


def run_config(
    config: Config, args: argparse.Namespace, seed: int, held_out: bytes, work: Path, netns: bool
) -> dict[str, Any]:
    out_dir = work / f"{config.name.replace(':', '_')}.seed{seed}"
    out_dir.mkdir(parents=True)
    command = launch_command(config, args.steps, seed, args.batch_size, args.lr, out_dir)
    machine_lo_before = None if netns else _machine_loopback()
    started = time.monotonic()
    run_job(command, out_dir / "launch.log", args.timeout, netns)
    wall = time.monotonic() - started
    stats = [json.loads((out_dir / f"stats.group{g}.json").read_text()) for g in range(GROUPS)]
    states = [torch.load(out_dir / f"model.group{g}.pt", weights_only=True) for g in range(GROUPS)]

    # Correctness: after the final sync both groups hold the same parameters, bit for bit.
    for name, tensor in states[0].items():
        if not torch.equal(tensor, states[1][name]):
            raise AssertionError(f"{config.name} seed {seed}: groups differ at the end in {name}")
    for stat in stats:
        if stat["global_step"] != args.steps:
            raise AssertionError(f"{config.name}: group {stat['group']} ended at global_step {stat['global_step']}")
    check_events(config, out_dir / "events")
    expected_syncs = expected_manager_steps(config, args.steps)
    if any(stat["manager_step"] != expected_syncs for stat in stats):
        raise AssertionError(
            f"{config.name}: Manager steps {[s['manager_step'] for s in stats]}, expected {expected_syncs} "
            f"(a sync was missed or did not commit)"
        )

    model = TinyLM()
    model.load_state_dict(states[0])
    loss = held_out_loss(model, held_out)
    payload = [stat["allreduce_bytes"] for stat in stats]
    if payload[0] != payload[1]:
        raise AssertionError(f"{config.name}: the groups sent different payloads {payload}")
    # Group 0's counters: lo after the first step and at the end (after the final sync), i.e. steps 2..N.
    lo_start, lo_end = stats[0]["loopback_after_first_step"], stats[0]["loopback_end"]
    result = {
        "config": config.name,
        **asdict(config),
        "seed": seed,
        "steps": args.steps,
        "held_out_nats_per_byte": loss,
        "held_out_bits_per_byte": loss / 0.6931471805599453,
        "train_loss_last20": [stat["train_loss_last20"] for stat in stats],
        "allreduce_calls_per_group": stats[0]["allreduce_calls"],
        "allreduce_bytes_per_group": payload[0],
        "allreduce_bytes_per_inner_step": payload[0] / args.steps,
        "manager_steps": stats[0]["manager_step"],
        "loopback_scope": "job network namespace" if netns else "machine-wide",
        "loopback_rx_bytes_per_inner_step": (lo_end[0] - lo_start[0]) / (args.steps - 1),
        "wall_seconds": wall,
        "train_seconds": max(stat["train_seconds"] for stat in stats),
    }
    if machine_lo_before is not None:
        result["machine_loopback_rx_bytes_whole_job"] = _machine_loopback() - machine_lo_before
    if not args.keep:
        shutil.rmtree(out_dir)
    return result


def check_events(config: Config, events_dir: Path) -> None:
    """Every step (``ddp``) or sync committed with both groups taking part, and the only heal is ``init_sync``'s at
    the job's first quorum (step 0): a later heal means a group threw work away, and the run would measure something
    else than the configuration."""
    records = read_events(events_dir)
    steps = [record for record in records if record["event"] == "step"]
    if not steps:
        raise AssertionError(f"{config.name}: no step events in {events_dir}")
    bad = [record for record in steps if not record["committed"] or record["participants"] != GROUPS]
    if bad:
        raise AssertionError(f"{config.name}: steps or syncs without both groups, or not committed: {bad[:3]}")
    late_heals = [record for record in records if record["event"] == "healed" and record["step"] != 0]
    if late_heals:
        raise AssertionError(f"{config.name}: a group healed after the start: {late_heals}")


def expected_manager_steps(config: Config, steps: int) -> int:
    """Committed Manager steps of a run without failures (see docs/semi-sync.md): ``ddp`` counts optimizer steps;
    the semi-synchronous algorithms count syncs: the join sync, one per period, and ``k - 1`` more final syncs for
    streaming DiLoCo (every fragment syncs at the end)."""
    if config.algorithm == "ddp":
        return steps
    fragments = config.fragments or 1
    period = config.sync_every // fragments
    return 1 + steps // period + (fragments - 1 if config.algorithm == "diloco" else 0)


def _machine_loopback() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    return 0


# ---------------------------------------------------------------------------------------------------- reporting
def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, the mean over seeds, with ratios against ``ddp``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        rows.setdefault(result["config"], []).append(result)
    summary = []
    for name, runs in rows.items():
        first = runs[0]
        summary.append(
            {
                "config": name,
                "algorithm": first["algorithm"],
                "sync_every": first["sync_every"],
                "fragments": first["fragments"],
                "seeds": [run["seed"] for run in runs],
                "bytes_per_step": statistics.mean(run["allreduce_bytes_per_inner_step"] for run in runs),
                "loopback_per_step": statistics.mean(run["loopback_rx_bytes_per_inner_step"] for run in runs),
                "bits_per_byte": statistics.mean(run["held_out_bits_per_byte"] for run in runs),
                "bits_per_byte_runs": [run["held_out_bits_per_byte"] for run in runs],
                "manager_steps": first["manager_steps"],
                "wall_seconds": statistics.mean(run["wall_seconds"] for run in runs),
            }
        )
    ddp = next((row for row in summary if row["config"] == "ddp"), None)
    for row in summary:
        row["bytes_ratio"] = row["bytes_per_step"] / ddp["bytes_per_step"] if ddp else None
        row["loss_delta"] = row["bits_per_byte"] - ddp["bits_per_byte"] if ddp else None
    return summary


def _bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def markdown_table(summary: list[dict[str, Any]]) -> str:
    seeds = max(len(row["seeds"]) for row in summary)
    loss_header = "held-out bits/byte" + (f" (mean of {seeds} seeds)" if seeds > 1 else "")
    lines = [
        f"| algorithm | sync_every | fragments | payload bytes / group / inner step | vs ddp | {loss_header} | "
        f"Δ vs ddp | syncs (Manager steps) | loopback bytes / inner step (all processes) | wall s (noisy) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        ratio = f"{row['bytes_ratio']:.4f}" if row["bytes_ratio"] is not None else ""
        if row["bytes_ratio"] is not None and row["bytes_ratio"] > 0:
            ratio = f"1/{1 / row['bytes_ratio']:.1f}" if row["bytes_ratio"] < 1 else "1"
        delta = f"{row['loss_delta']:+.3f}" if row["loss_delta"] is not None else ""
        loss = f"{row['bits_per_byte']:.3f}"
        if len(row["bits_per_byte_runs"]) > 1:
            loss += " (" + ", ".join(f"{value:.3f}" for value in row["bits_per_byte_runs"]) + ")"
        lines.append(
            f"| {row['algorithm']} | {row['sync_every'] or 1} | {row['fragments'] or 1} "
            f"| {_bytes(row['bytes_per_step'])} "
            f"| {ratio} | {loss} | {delta} | {row['manager_steps']} | {_bytes(row['loopback_per_step'])} "
            f"| {row['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"ddp": ("black", "s"), "local_sgd": ("tab:blue", "o"), "diloco": ("tab:red", "^")}
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for algorithm, (color, marker) in styles.items():
        rows = [row for row in summary if row["algorithm"] == algorithm]
        for streaming in (False, True):
            points = [row for row in rows if bool(row["fragments"] and row["fragments"] > 1) == streaming]
            if not points:
                continue
            label = algorithm + (" (streaming)" if streaming else "")
            if algorithm == "ddp":
                axes.axhline(points[0]["bits_per_byte"], color=color, lw=0.8, ls="--", zorder=1)
            elif not streaming:
                ordered = sorted(points, key=lambda row: row["bytes_per_step"])
                axes.plot(
                    [row["bytes_per_step"] for row in ordered],
                    [row["bits_per_byte"] for row in ordered],
                    color=color,
                    lw=0.8,
                    alpha=0.6,
                    zorder=2,
                )
            axes.scatter(
                [row["bytes_per_step"] for row in points],
                [row["bits_per_byte"] for row in points],
                color=color,
                marker=marker,
                facecolors="none" if streaming else color,
                s=60,
                label=label,
                zorder=3,
            )
            for row in points:
                for value in row["bits_per_byte_runs"] if len(row["bits_per_byte_runs"]) > 1 else []:
                    axes.plot([row["bytes_per_step"]] * 2, [row["bits_per_byte"], value], color=color, lw=0.8)
                if row["sync_every"]:
                    text = f"H={row['sync_every']}" + (f"×{row['fragments']}" if streaming else "")
                    axes.annotate(
                        text,
                        (row["bytes_per_step"], row["bits_per_byte"]),
                        textcoords="offset points",
                        xytext=(6, -11 if algorithm == "diloco" and not streaming else 4),
                        fontsize=8,
                        color=color,
                    )
    axes.set_xscale("log")
    axes.set_xlabel("allreduce payload bytes per group per inner step (log)")
    axes.set_ylabel(f"held-out loss after {steps} inner steps (bits/byte)")
    axes.set_title("2 replica groups, tiny byte-level transformer (mean of seeds; bars: each seed)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def _write_report(
    args: argparse.Namespace, netns: bool, held_out: bytes, results: list[dict[str, Any]], partial: bool
) -> dict[str, Any]:
    """Written after every run (``"partial": true`` until the last), so an interrupted benchmark keeps its runs."""
    report = {
        "command": " ".join(["python", "-m", "benchmarks.semi_sync.semi_sync", *sys.argv[1:]]),
        "partial": partial,
        **header(),
        "setup": {
            "groups": GROUPS,
            "processes_per_group": 1,
            "steps": args.steps,
            "batch_size_per_group": args.batch_size,
            "context": CONTEXT,
            "lr": args.lr,
            "parameters": parameter_count(TinyLM()),
            "corpus_sha256_16": corpus_digest(),
            "held_out_bytes": len(held_out),
            "loopback_scope": "job network namespace" if netns else "machine-wide",
        },
        "results": results,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=1) + "\n")
    return report


# ---------------------------------------------------------------------------------------------------- main
def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=Config.parse, default=[Config.parse(c) for c in DEFAULT_CONFIGS])
    parser.add_argument("--steps", type=int, default=480, help="inner steps per run (a multiple of every sync period)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per group per inner step")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate (warmup, cosine)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is stopped")
    parser.add_argument(
        "--results",
        type=Path,
        help="the results file (default: a new results/semi_sync/<UTC>_<commit>.json; with --report-only, the newest)",
    )
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "semi-sync-benchmark.png", help="plot")
    parser.add_argument("--no-netns", action="store_true", help="do not run jobs in a private network namespace")
    parser.add_argument("--keep", action="store_true", help="keep each run's logs and weights (printed directory)")
    parser.add_argument("--report-only", action="store_true", help="table and plot from --results, run nothing")
    args = parser.parse_args()
    # A SIGTERM to this script stops the running job too (run_job stops it on any exception).
    signal.signal(signal.SIGTERM, _raise_system_exit)

    if args.report_only:
        args.results = args.results or newest(SECTION)
        if args.results is None:
            parser.error(f"no results file under {RESULTS / SECTION}")
        report = json.loads(args.results.read_text())
    else:
        args.results = new_results_file(SECTION, args.results, args.label)
        for config in args.configs:
            period = (config.sync_every or 1) // (config.fragments or 1)
            if args.steps % period:
                parser.error(f"--steps={args.steps} is not a multiple of {config.name}'s sync period {period}")
        netns = not args.no_netns and netns_available()
        print(f"loopback counters: {'per-job network namespace' if netns else 'machine-wide'}", flush=True)
        _, held_out = load_corpus()
        work = Path(tempfile.mkdtemp(prefix="semi_sync_bench."))
        results = []
        for seed in args.seeds:
            for config in args.configs:
                print(f"[{time.strftime('%H:%M:%S')}] {config.name} seed {seed} ...", flush=True)
                result = run_config(config, args, seed, held_out, work, netns)
                results.append(result)
                _write_report(args, netns, held_out, results, partial=True)
                print(
                    f"    held-out {result['held_out_bits_per_byte']:.4f} bits/byte, "
                    f"{result['allreduce_bytes_per_inner_step']:.0f} payload bytes/step, "
                    f"{result['manager_steps']} Manager steps, {result['wall_seconds']:.0f} s",
                    flush=True,
                )
        if args.keep:
            print(f"logs and weights kept under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        report = _write_report(args, netns, held_out, results, partial=False)
        print(f"results: {args.results}")

    summary = summarise(report["results"])
    table = markdown_table(summary)
    print(table)
    in_section = args.results.resolve().parent == (RESULTS / SECTION).resolve()
    (RESULTS / SECTION / "latest.md" if in_section else args.results.with_suffix(".md")).write_text(table + "\n")
    plot(summary, args.out, report["setup"]["steps"])
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

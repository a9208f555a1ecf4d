"""Every benchmark driver of every ``make`` target, once, at its smallest size: do they all still run?

A measurement takes hours (``benchmarks/README.md``); this takes about 15 minutes on 2 CPU cores and answers only
whether each driver, renderer and summary still runs end to end on the current code: a refactor of the package or of
``tests/support/`` can break a driver that no test imports. Each driver writes its figures to a temporary folder,
never to ``benchmarks/results/<section>/``: at these sizes they are no measurement, and the renderers would count
them. What is kept is the record of the smoke run itself, ``results/smoke/<UTC>_<commit>.json``: each driver's make
target, command, exit code and seconds, and the machine.

    python -m benchmarks.smoke                  # every driver
    python -m benchmarks.smoke --only zoo scale # the drivers of these targets

``make bench-gpu`` runs here with ``--tiny`` (a tiny model on the CPU); its figures need a lent GPU. The fault matrix
runs the real-process tests that ``make test`` runs; here only its table is redrawn from the kept results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.results import RESULTS, header, new_results_file
from benchmarks.common.run_util import REPO, repo_env

SECTION = "smoke"
DRIVER_TIMEOUT_S = 900


def drivers(scratch: Path) -> list[tuple[str, str, list[str]]]:
    """(make target, module, arguments) of every driver, at its smallest size, writing under ``scratch``."""
    out = lambda name: str(scratch / name)  # noqa: E731 - one line per driver below
    return [
        ("bench", "benchmarks.overhead.overhead", ["--sizes", "1m", "--repeats", "1", "--out", out("overhead.json")]),
        ("bench", "benchmarks.heal.heal_throughput",
         ["--sizes", "1", "--repeats", "1", "--transports", "http", "pg", "--out", out("heal.json")]),
        ("bench", "benchmarks.goodput.goodput",
         ["--horizon", "40", "--kill-every", "15", "--every", "20", "--repeats", "1", "--out", out("goodput.json")]),
        ("bench", "benchmarks.performance.cluster_model",
         ["--out-png", out("cluster.png"), "--out-md", out("cluster.md")]),
        ("bench", "benchmarks.performance.report", ["--out-md", out("report.md"), "--out-png", out("report.png")]),
        ("bench-semi-sync", "benchmarks.semi_sync.semi_sync",
         ["--configs", "ddp", "local_sgd:8", "diloco:8", "--steps", "16", "--seeds", "0", "--no-netns",
          "--results", out("semi_sync.json"), "--out", out("semi_sync.png")]),
        ("bench-zoo", "benchmarks.zoo.zoo",
         ["--models", "mlp-0.3m", "--accumulate", "1", "--repeats", "1", "--out", out("zoo.json"),
          "--modes", "ddp", "ddp_quorum", "ddp_torchft", "ddp_as_ft_quorum", "ft", "--plot", out("zoo-run.png")]),
        ("bench-zoo", "benchmarks.zoo.zoo", ["--summary", "--plot", out("zoo.png")]),
        ("bench-zoo", "benchmarks.zoo.protocol_floor",
         ["--steps", "100", "--repetitions", "1", "--out", out("protocol_floor.json")]),
        ("bench-scale", "benchmarks.scale.scale", ["--groups", "2", "--repeats", "1", "--out", out("scale.json")]),
        ("bench-scale", "benchmarks.scale.scale_kills",
         ["--groups", "4", "--repeats", "1", "--out", out("scale_kills.json")]),
        ("bench-scale", "benchmarks.scale.lighthouse_scale", ["--groups", "8", "--out", out("lighthouse.json")]),
        ("bench-scale", "benchmarks.scale.heal_fanout",
         ["--size", "1", "--fanouts", "1", "2", "--repeats", "1", "--out", out("fanout.json")]),
        ("bench-scale", "benchmarks.scale.scale_plot", ["--out", out("scale.png")]),
        ("bench-buffers", "benchmarks.buffers.buffers", ["--repeats", "1", "--out", out("buffers.json")]),
        ("bench-gpu", "benchmarks.gpu.gpu_step", ["--tiny", "--out", out("gpu.json")]),
        ("bench-kill-loop", "benchmarks.kill_loop.kill_loop", ["--kills", "2", "--out", out("kill_loop.json")]),
        ("bench-data-modes", "benchmarks.data_modes.data_modes", ["--repeats", "1", "--out", out("data_modes.json")]),
        ("fault-matrix", "benchmarks.fault_matrix.fault_matrix", ["--report-only"]),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="the make targets whose drivers run (default: every one)")
    args = parser.parse_args()
    record_file = new_results_file(SECTION)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as scratch:
        for target, module, driver_args in drivers(Path(scratch)):
            if args.only and target not in args.only:
                continue
            command = [sys.executable, "-m", module, *driver_args]
            print(f"== {target}: {' '.join(command[1:])}", flush=True)
            started = time.monotonic()
            try:
                done = subprocess.run(
                    command, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S
                )
                code, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as expired:
                code, output = None, f"timed out after {DRIVER_TIMEOUT_S} s: {expired}"
            seconds = round(time.monotonic() - started, 1)
            runs.append({"target": target, "module": module, "args": driver_args, "exit_code": code,
                         "seconds": seconds, "tail": "" if code == 0 else output[-2000:]})  # fmt: skip
            print(f"   exit {code} in {seconds} s" + ("" if code == 0 else f"\n{output[-2000:]}"), flush=True)
    failed = [run for run in runs if run["exit_code"] != 0]
    record_file.write_text(json.dumps({**header(), "runs": runs, "failed": len(failed)}, indent=1) + "\n")
    print(f"{len(runs) - len(failed)} of {len(runs)} drivers ran; record: {record_file.relative_to(RESULTS.parent)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

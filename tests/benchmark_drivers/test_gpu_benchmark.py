"""``benchmarks/gpu/gpu_step.py`` as far as a machine without a GPU can run it: its arguments, the GPU idle arithmetic,
the order of the modes, the worker's command, and the table of a recorded results file (a lent GPU's run, kept in
``benchmarks/results/gpu_step/``)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from helpers import REPO

if str(REPO) not in sys.path:  # the benchmarks are the package ``benchmarks`` at the repository's root
    sys.path.insert(0, str(REPO))
gpu_step = importlib.import_module("benchmarks.gpu.gpu_step")

pytestmark = pytest.mark.timeout(60)


def test_the_defaults_cover_every_mode_precision_and_step_size():
    args = gpu_step.parse_args([])
    assert args.modes == ["plain", "plain-sync", "ddp", "ft"] and args.repeats == 2 and args.heal_mb == 1000
    assert {(p, s) for p in args.precisions for s in args.sizes} == set(gpu_step.BATCH)


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--repeats", "0"], ["--profile-steps", "-1"], ["--modes", "x"]])
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as refused:
        gpu_step.parse_args(bad)
    assert refused.value.code == 2  # argparse's refusal, naming the setting
    assert bad[0] in capsys.readouterr().err


def test_gpu_idle_is_the_window_no_kernel_covers_per_step():
    # Kernels (µs): 0-10 and 5-20 overlap, a gap 20-30, 30-40, a gap 40-50, 50-60: 20 µs idle over 2 steps.
    kernels = [(30.0, 40.0), (0.0, 10.0), (50.0, 60.0), (5.0, 20.0)]
    assert gpu_step.gpu_idle_per_step(kernels, steps=2) == pytest.approx(10e-6)
    assert gpu_step.gpu_idle_per_step([(0.0, 5.0), (1.0, 2.0)], steps=1) == 0.0  # a kernel inside another
    assert gpu_step.gpu_idle_per_step([], steps=3) is None


def test_repetitions_alternate_the_order_of_the_modes():
    assert gpu_step.mode_order(["plain", "ddp", "ft"], 0) == ["plain", "ddp", "ft"]
    assert gpu_step.mode_order(["plain", "ddp", "ft"], 1) == ["ft", "ddp", "plain"]


def test_the_worker_gets_the_configurations_and_lengths(tmp_path):
    args = gpu_step.parse_args(["--precisions", "bf16-mixed", "--sizes", "10ms", "--steps", "7"])
    command = gpu_step.worker_command("ft", args, tmp_path / "r.json")
    assert "--worker=ft" in command and "--steps=7" in command
    assert command[command.index("--precisions") + 1] == "bf16-mixed"
    assert command[command.index("--sizes") + 1] == "10ms"


def recorded_results() -> dict:
    recorded = sorted((REPO / "benchmarks" / "results" / "gpu_step").glob("*.json"))
    if recorded:
        return json.loads(recorded[-1].read_text())
    record = {"precision": "bf16-mixed", "size": "10ms", "rows": 8192, "implicit_syncs_per_step": 0.0}
    return {
        "gpu": "a stand-in",
        "torch": "2.11",
        "runs": [
            [{**record, "mode": "plain", "step_ms": 10.0, "gpu_idle_ms": 0.0},
             {**record, "mode": "ft", "step_ms": 10.5, "gpu_idle_ms": 0.2}],
        ],
        "heal": {"rows": [{"transport": "http", "size_bytes": 10**9, "median_s": 0.5, "gb_per_s": 2.0,
                           "seconds": [0.5, 0.5], "sender_stage_s": [0.1, 0.1]}]},
    }  # fmt: skip


def test_the_table_of_a_recorded_run_has_every_configuration_and_the_ratio_to_plain(tmp_path, capsys):
    results = recorded_results()
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    gpu_step.main(["--table", str(path)])
    printed = capsys.readouterr().out
    configurations = {(r["precision"], r["size"], r["mode"]) for run in results["runs"] for r in run}
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(configurations)
    for precision, size, mode in configurations:
        [row] = [line for line in rows if line.startswith(f"| {precision} | {size} | {mode} |")]
        if mode == "plain":
            assert "1.000" in row
    assert ("GB/s" in printed) == bool(results.get("heal")), "the heal line, when the run healed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_where_to_measure_instead():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu_step.main(["--repeats", "1", "--out", "/nonexistent/never-written.json"])


@pytest.mark.timeout(240)
def test_the_whole_script_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    """``--tiny``: the same driver, workers, Trainers and profiler, with a small MLP on the CPU (no GPU figures); the
    profiler runs in the ``plain`` worker only (torch's profiler beside torchft's threads on the CPU: gpu_step.py)."""
    out = tmp_path / "tiny.json"
    gpu_step.main(
        [
            *("--tiny", "--modes", "plain", "ft", "--precisions", "32-true", "--sizes", "10ms", "--repeats", "1"),
            *("--steps", "2", "--warmup", "1", "--profile-steps", "1", "--heal-mb", "0", "--out", str(out)),
        ]
    )
    [run] = json.loads(out.read_text())["runs"]
    assert sorted(record["mode"] for record in run) == ["ft", "plain"]
    assert all(record["step_ms"] > 0 for record in run)
    profiled = {record["mode"]: record for record in run}["plain"]
    assert profiled["implicit_syncs_per_step"] is not None and profiled["top_cpu_ms_per_step"], (
        "the profiled steps were never closed"
    )

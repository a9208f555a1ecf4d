"""On one GPU: the step time of FTStrategy against the same Trainer without fault tolerance (issue 36).

Four modes, each in its own process, on the one GPU in turn:

* ``plain``: Lightning's default strategy on one device, no fault tolerance;
* ``plain-sync``: the same, with one synchronization of the current stream per step, after gradient clipping and
  before the optimizer's update, where torchft's vote (``Manager.should_commit``) synchronized until lightning-ft's
  vote fence (``lightning_ft/manager/vote_fence.py``; the vote's sync now waits for the end of the backward pass
  only): the least a step with a whole-stream sync there can cost, since the GPU idles from there until the
  optimizer's first kernel is launched;
* ``ddp``: ``DDPStrategy`` with one process (NCCL);
* ``ft``: ``FTStrategy()`` with one replica group of one process (NCCL inside the group and across groups, the
  embedded lighthouse): every per-step piece of fault tolerance runs (quorum, vote, the cross-group allreduce of
  every gradient bucket, the buffers' average, the event log); its records count the votes that waited for the
  vote fence's mark only (``votes_fenced``).

Each mode trains an MLP of ``DEPTH`` layers of width ``WIDTH`` (about 134 M parameters) with AdamW and clipping 1.0,
on a batch made on the device, in every configuration: precision (``32-true``, ``bf16-mixed``) × step size (a batch
sized for about 10 ms and about 100 ms per step on an H100/H200). A configuration's figure is the mean step time over
``--steps`` steps after ``--warmup``, from a device sync to a device sync. Then ``--profile-steps`` steps run under
``torch.profiler``: the GPU idle time per step is the part of that window no kernel covers, and
``torch.cuda.set_sync_debug_mode`` counts the host-device syncs per step (torchft's vote's stream synchronization
included). Repetitions alternate the order of the modes;
a configuration's ratio is ``ft`` ÷ ``plain`` of the same repetition (and ``ddp`` ÷ ``plain`` beside it).

Beside the step time, each record holds the CPU time per measured step of the training thread and of the whole process
(torchft's threads included): a step whose training thread takes as long as the GPU does is bound by the CPU, not the
GPU. Where the implicit syncs come from (file and line of the Python frame that asked) is kept too, and
``--trace-dir`` writes the first repetition's profiled steps as Chrome traces (``chrome://tracing``, Perfetto).

``--heal-mb`` adds a heal of that much CUDA state between two processes on the one GPU: ``heal/heal_throughput.py`` with
``--device cuda`` (the HTTP transport that a heal uses; the sender copies the state off the device, the receiver
back onto it).

Nothing is installed at run time (a lent GPU machine has no network). Usage::

    python -m benchmarks.gpu.gpu_step                      # everything: under 5 minutes on one H100 or H200
    python -m benchmarks.gpu.gpu_step --repeats 1 --sizes 10ms --precisions bf16-mixed
    python -m benchmarks.gpu.gpu_step --table benchmarks/results/gpu_step/<UTC>_<commit>.json   # a file's table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import median, module_command, repo_env

MODES = ("plain", "plain-sync", "ddp", "ft")
PRECISIONS = ("32-true", "bf16-mixed")
SIZES = ("10ms", "100ms")
WIDTH, DEPTH = 4096, 8
# Rows of the batch for each step size and precision: about 10 ms and 100 ms per step on an H100/H200 (the 134 M MLP
# took 117 ms at 8192 rows in fp32 and 11 ms in bf16-mixed on an H200).
BATCH = {
    ("32-true", "10ms"): 768,
    ("32-true", "100ms"): 8192,
    ("bf16-mixed", "10ms"): 8192,
    ("bf16-mixed", "100ms"): 65536,
}
WORKER_TIMEOUT_S = 240


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the measurement")
    parser.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler (0: none)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--heal-mb", type=int, default=1000, help="CUDA state healed between two processes (0: none)")
    parser.add_argument("--out", type=Path, help="a new file (default: results/gpu_step/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--table", type=Path, help="only print the table of this results file")
    parser.add_argument(
        "--trace-dir", type=Path, help="write the first repetition's profiled steps here, one gzipped Chrome trace each"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU: checks the script on a machine without a GPU"
    )
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.profile_steps < 0 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1, --profile-steps at least 0")
    return args


# --- one mode's process -----------------------------------------------------------------------------------------


def gpu_idle_per_step(kernels: list[tuple[float, float]], steps: int) -> float | None:
    """Seconds per step that no kernel covers, between the first kernel's start and the last one's end.

    ``kernels`` are (start, end) pairs in microseconds, in any order, overlapping or not.
    """
    if not kernels or steps < 1:
        return None
    kernels = sorted(kernels)
    busy, current_start, current_end = 0.0, kernels[0][0], kernels[0][1]
    for start, end in kernels[1:]:
        if start > current_end:
            busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += current_end - current_start
    window = max(end for _, end in kernels) - kernels[0][0]
    return (window - busy) / steps / 1e6


def run_worker(mode: str, configs: list[tuple[str, str]], args: argparse.Namespace, result: Path) -> None:
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    from lightning_ft import FTStrategy

    cuda = not args.tiny
    width, depth = (64, 2) if args.tiny else (WIDTH, DEPTH)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Indices(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, index: int) -> int:
            return index

    class MLP(pl.LightningModule):
        def __init__(self, rows: int) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers)
            self.rows = rows
            self.inputs: torch.Tensor | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.inputs is None:  # made on the device once: the data loader moves only indices
                generator = torch.Generator(device=self.device).manual_seed(0)
                self.inputs = torch.randn(self.rows, width, device=self.device, generator=generator)
            return self.net(self.inputs).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def configure_gradient_clipping(self, optimizer: Any, **clipping: Any) -> None:
            super().configure_gradient_clipping(optimizer, **clipping)
            if mode == "plain-sync" and cuda:  # as torchft's vote does: after clipping, before the update
                torch.cuda.current_stream().synchronize()

    class Clock(pl.Callback):
        """Device-synced times at the measurement's ends; the profiler and sync counting over the last steps."""

        def __init__(self) -> None:
            self.seconds: float | None = None
            self.idle: float | None = None
            self.syncs: int | None = None
            self.top_cpu: list[Any] = []  # the operations with the most CPU time of their own, ms per step
            self.sync_sites: dict[str, int] = {}  # where the implicit syncs were asked for: file:line -> count
            self.thread_cpu: float | None = None  # CPU seconds per measured step: the training thread's
            self.process_cpu: float | None = None  # and the whole process's (torchft's threads included)
            self.trace: Path | None = None  # where to write the profiled steps' Chrome trace, if anywhere
            self.votes_fenced: int | None = None  # FTStrategy's votes that waited for the backward pass's end only
            self._started = 0.0
            self._cpu_started = (0.0, 0.0)
            self._profiler: Any = None
            self._warnings: Any = None
            self._caught: list[Any] = []

        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
            if i == args.warmup:
                synchronize()
                self._started = time.perf_counter()
                self._cpu_started = (time.thread_time(), time.process_time())
            elif i == args.warmup + args.steps and args.profile_steps and (cuda or mode != "ft"):
                # Not the ``ft`` worker on the CPU (``--tiny``): torch 2.13's profiler, parsing CPU events recorded
                # beside torchft's threads, died once in about 50 CI runs (std::bad_alloc in ``kineto_event.stack()``,
                # then SIGSEGV). The GPU runs this measures are not affected; ``--tiny`` profiles ``plain`` only.
                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=activities)
                self._profiler.__enter__()
                self._warnings = warnings.catch_warnings(record=True)
                self._caught = self._warnings.__enter__()
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(
            self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, i: int
        ) -> None:
            if i == args.warmup + args.steps - 1:
                synchronize()
                self.seconds = (time.perf_counter() - self._started) / args.steps
                self.thread_cpu = (time.thread_time() - self._cpu_started[0]) / args.steps
                self.process_cpu = (time.process_time() - self._cpu_started[1]) / args.steps
                fence = (
                    getattr(getattr(trainer.strategy, "step_protocol", None), "vote_fence", None)
                    if mode == "ft"
                    else None
                )
                self.votes_fenced = fence.votes_fenced if fence is not None else None
            elif i == args.warmup + args.steps + args.profile_steps - 1 and self._profiler is not None:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                self._warnings.__exit__(None, None, None)
                syncs = [w for w in self._caught if "synchronizing" in str(w.message)]
                self.syncs = len(syncs)
                for w in syncs:
                    site = f"{w.filename}:{w.lineno}"
                    self.sync_sites[site] = self.sync_sites.get(site, 0) + 1
                synchronize()
                self._profiler.__exit__(None, None, None)
                if self.trace is not None:
                    self._write_trace(self.trace)
                kernels = [
                    (event.time_range.start, event.time_range.end)
                    for event in self._profiler.events()
                    if event.device_type == torch.autograd.DeviceType.CUDA
                ]
                self.idle = gpu_idle_per_step(kernels, args.profile_steps)
                averages = sorted(self._profiler.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
                self.top_cpu = [
                    [a.key, round(a.self_cpu_time_total / 1e3 / args.profile_steps, 3), a.count] for a in averages[:25]
                ]

        def _write_trace(self, path: Path) -> None:
            import gzip
            import shutil

            path.parent.mkdir(parents=True, exist_ok=True)
            plain = path.with_suffix("")  # name.json.gz -> name.json
            self._profiler.export_chrome_trace(str(plain))
            with plain.open("rb") as source, gzip.open(path, "wb") as target:
                shutil.copyfileobj(source, target)
            plain.unlink()

    torch.backends.cuda.matmul.allow_tf32 = False
    records = []
    for precision, size in configs:
        rows = 32 if args.tiny else BATCH[(precision, size)]
        torch.manual_seed(0)
        strategy: Any = {"plain": "auto", "plain-sync": "auto", "ddp": DDPStrategy(), "ft": FTStrategy()}[mode]
        clock = Clock()
        if args.trace_dir is not None:
            clock.trace = args.trace_dir / f"{mode}_{precision}_{size}.json.gz"
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            strategy=strategy,
            precision=precision,
            max_steps=args.warmup + args.steps + args.profile_steps,
            gradient_clip_val=1.0,
            callbacks=[clock],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(MLP(rows), DataLoader(Indices(), batch_size=1))
        record = {
            "mode": mode,
            "precision": precision,
            "size": size,
            "rows": rows,
            "step_ms": clock.seconds * 1e3 if clock.seconds is not None else None,
            "gpu_idle_ms": clock.idle * 1e3 if clock.idle is not None else None,
            "implicit_syncs_per_step": clock.syncs / args.profile_steps if clock.syncs is not None else None,
            "implicit_sync_sites": clock.sync_sites,
            "thread_cpu_ms_per_step": clock.thread_cpu * 1e3 if clock.thread_cpu is not None else None,
            "process_cpu_ms_per_step": clock.process_cpu * 1e3 if clock.process_cpu is not None else None,
            "top_cpu_ms_per_step": clock.top_cpu,
            "votes_fenced": clock.votes_fenced,
        }
        records.append(record)
        print(json.dumps(record), flush=True)
        result.write_text(json.dumps(records))
        del trainer
        if cuda:
            torch.cuda.empty_cache()


# --- the driver -------------------------------------------------------------------------------------------------


def worker_command(mode: str, args: argparse.Namespace, result: Path, trace: bool = False) -> list[str]:
    """One mode's process; ``trace``: it writes its profiled steps' Chrome traces into ``args.trace_dir``."""
    command = module_command(__spec__.name, f"--worker={mode}", f"--result={result}")
    command += ["--precisions", *args.precisions, "--sizes", *args.sizes]
    command += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--profile-steps={args.profile_steps}"]
    if trace and args.trace_dir is not None:
        command.append(f"--trace-dir={args.trace_dir}")
    return command + (["--tiny"] if args.tiny else [])


def mode_order(modes: list[str], repeat: int) -> list[str]:
    """Alternate the order of the modes between repetitions, so that a drift of the machine favours none."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


def run_mode(mode: str, args: argparse.Namespace, scratch: Path, trace: bool = False) -> list[dict[str, Any]]:
    result = scratch / f"{mode}.json"
    result.unlink(missing_ok=True)
    env = {**repo_env(), "PYTHONUNBUFFERED": "1"}
    command = worker_command(mode, args, result, trace)
    completed = subprocess.run(command, env=env, timeout=WORKER_TIMEOUT_S, check=False)
    if completed.returncode != 0:
        print(f"gpu_step: mode {mode} exited {completed.returncode}", file=sys.stderr)
    return json.loads(result.read_text()) if result.exists() else []


def run_heal(megabytes: int, scratch: Path) -> dict[str, Any] | None:
    out = scratch / "heal.json"
    command = module_command("benchmarks.heal.heal_throughput", "--device=cuda")
    command += ["--transports", "http", "--sizes", str(megabytes), "--repeats", "2", f"--out={out}"]
    completed = subprocess.run(command, env=repo_env(), timeout=WORKER_TIMEOUT_S, check=False)
    if completed.returncode != 0 or not out.exists():
        print(f"gpu_step: the heal exited {completed.returncode}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per repetition and configuration: each mode's step time and GPU idle, and its ratio to ``plain``'s."""
    rows = []
    for repeat, records in enumerate(runs):
        plain = {(r["precision"], r["size"]): r for r in records if r["mode"] == "plain"}
        for record in records:
            base = plain.get((record["precision"], record["size"]))
            ratio = None
            if base and base["step_ms"] and record["step_ms"]:
                ratio = record["step_ms"] / base["step_ms"]
            rows.append({**record, "repeat": repeat, "ratio_to_plain": ratio})
    return rows


def table(results: dict[str, Any]) -> str:
    """The results as a Markdown table: one row per configuration and mode, every repetition's ratio."""
    rows = ratios(results["runs"])
    keys = sorted({(r["precision"], r["size"], r["mode"]) for r in rows}, key=lambda k: (k[0], k[1], MODES.index(k[2])))
    lines = [
        f"GPU: {results.get('gpu', '?')}; torch {results.get('torch', '?')}; commit {results.get('commit', '?')}",
        "",
        "| precision | step | mode | step ms (median) | × plain, each repetition | GPU idle ms/step "
        "| implicit syncs/step | CPU ms/step, training thread / process |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def median_of(records: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in records if r.get(key) is not None]
        return f"{median(values):.{1 if key == 'implicit_syncs_per_step' else 2}f}" if values else ""

    for precision, size, mode in keys:
        mine = [r for r in rows if (r["precision"], r["size"], r["mode"]) == (precision, size, mode)]
        each = ", ".join(f"{r['ratio_to_plain']:.3f}" for r in mine if r["ratio_to_plain"] is not None)
        cpu = median_of(mine, "thread_cpu_ms_per_step")
        if cpu:
            cpu += f" / {median_of(mine, 'process_cpu_ms_per_step')}"
        lines.append(
            f"| {precision} | {size} | {mode} | {median_of(mine, 'step_ms') or 'nan'} | {each} | "
            f"{median_of(mine, 'gpu_idle_ms')} | {median_of(mine, 'implicit_syncs_per_step')} | {cpu} |"
        )
    heal = results.get("heal")
    for row in (heal or {}).get("rows", []):
        stage = row.get("sender_stage_s")
        staged = f"; the sender's copy off the device took {median(stage):.2f} s more" if stage else ""
        lines += [
            "",
            f"Heal of {row['size_bytes'] / 1e9:.2f} GB of CUDA state ({row['transport']}, received onto the device): "
            f"{row['median_s']:.2f} s, {row['gb_per_s']:.2f} GB/s (median of {len(row['seconds'])}){staged}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    configs = [(precision, size) for precision in args.precisions for size in args.sizes]
    if args.worker is not None:
        run_worker(args.worker, configs, args, args.result)
        sys.stdout.flush()
        # Seen on CPU with torch 2.13: a process that ran torch.profiler beside torchft's threads can die of SIGSEGV
        # at interpreter exit, after every record is written. Leave without the interpreter's teardown.
        os._exit(0)
    import tempfile

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("gpu_step.py needs a CUDA GPU; on CPU, see benchmarks/zoo/zoo.py (its workers time the critical path)")
    out = new_results_file("gpu_step", args.out, args.label)
    results: dict[str, Any] = {
        "benchmark": "gpu_step",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (--tiny, on the CPU)",
        "torch": torch.__version__,
        **header(),
        "configs": configs,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "runs": [],
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            records: list[dict[str, Any]] = []
            for mode in mode_order(args.modes, repeat):
                records += run_mode(mode, args, Path(scratch), trace=repeat == 0)
            results["runs"].append(records)
            out.write_text(json.dumps(results, indent=1))
        if args.heal_mb and not args.tiny:
            results["heal"] = run_heal(args.heal_mb, Path(scratch))
    results["seconds"] = time.monotonic() - started
    out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"results: {out}")


if __name__ == "__main__":
    main()

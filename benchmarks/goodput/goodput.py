"""Goodput under a failure schedule: lightning-ft against restart-from-checkpoint, side by side (issue 7).

Both sides train the 1M-parameter MLP of ``common/bench_model.py`` with 3 workers (1 compute thread each) on this
machine, for a fixed wall-clock horizon from launch, once without failures and once with a SIGKILL of a random worker
every ``--kill-every`` seconds (the same seeded schedule of victims for both):

* ``restart-S``: the classic approach of the torchrun tutorial, in Lightning: ``DDPStrategy`` over Gloo under
  ``torchrun --standalone --nproc-per-node 3 --max-restarts 20``, ``ModelCheckpoint(every_n_train_steps=S,
  save_last=True)`` written by rename (a kill during a save leaves the previous checkpoint whole), every restart
  resuming from ``last.ckpt``. torchrun restarts all 3 workers after any one dies.
* ``ft``: ``lightning-ft launch --replica-groups 3 --max-restarts 20`` with ``FTStrategy()`` and the launcher's
  defaults: 3 replica groups of 1 process; the killed group is restarted by its torchrun and heals from a live peer.

Figures, for each side: **goodput** = committed steps (and samples) at the horizon with failures ÷ without;
**absolute progress** = committed steps at the horizon with failures ÷ the restart baseline's steps without
failures. For ``ft`` also the recovery of every kill, from its event log and the workers' own timestamps: kill →
survivors commit again (a step of the surviving groups only), and kill → the restarted group's first commit, split
into torchrun's respawn, imports, setup (Trainer, Manager, quorum join) and the first step (of which the heal).
Usage::

    python -m benchmarks.goodput.goodput                  # horizon 105 s, kills at 30, 60, 90 s (about 8 minutes)
    python -m benchmarks.goodput.goodput --repeats 2 --every 50 200

Each run writes a new file, ``results/goodput/<UTC>_<commit>.json`` unless ``--out`` names another new one, and
refuses to replace an existing file: ``performance/report.py`` gives every verdict over all of them (issue 23).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import LIGHTNING_FT, REPO, bench_env, median
from lightning_ft_job.events import read_events

WORLD = 3
BATCH = 64
WORKER = Path(__file__).with_name("goodput_worker.py")


# Extra ``lightning-ft launch`` options for the ft side (``--launch-arg``); empty for the published figures.
LAUNCH_ARGS: list[str] = []


def command(config: str, root: Path) -> list[str]:
    worker = [str(WORKER), f"--root={root}", f"--world={WORLD}"]
    if config == "ft":
        launch = [*LIGHTNING_FT, "launch", f"--replica-groups={WORLD}", "--max-restarts=20", *LAUNCH_ARGS]
        return [*launch, f"--events-dir={root / 'events'}", "--", "python", *worker, "--mode=ft"]
    every = int(config.split("-")[1])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    return [*torchrun, "--max-restarts=20", *worker, "--mode=restart", f"--every={every}"]


def alive_worker(pid: int) -> bool:
    try:
        return "goodput_worker.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def kill_one(root: Path, config: str, rng: random.Random) -> dict[str, Any] | None:
    """SIGKILL the seeded victim if it is training, else the next worker that is; by the PID it wrote."""
    prefix = "group" if config == "ft" else "rank"
    first = rng.randrange(WORLD)
    for victim in [(first + i) % WORLD for i in range(WORLD)]:
        try:
            pid = int((root / "pids" / f"{prefix}{victim}.pid").read_text())
        except (OSError, ValueError):
            continue
        if alive_worker(pid):
            os.kill(pid, signal.SIGKILL)
            return {"time": time.time(), "victim": victim, "pid": pid}
    return None


def leftover_workers(root: Path) -> list[int]:
    """PIDs of this run's training processes that are still alive: ``goodput_worker.py`` with this run's ``--root``."""
    marker = f"--root={root}"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(arg.endswith("goodput_worker.py") for arg in argv) and marker in argv:
                pids.append(int(entry.name))
    return pids


def kill_leftover_workers(root: Path, timeout: float = 10.0) -> None:
    """SIGKILL this run's workers that outlived it, and wait until they are gone.

    torchrun starts each worker in a session of its own, so killing torchrun's session does not reach them. A worker
    that did not act on torchrun's SIGTERM in time (one stuck in a Gloo collective with a dead peer) lived on as an
    orphan until its collective timed out, up to 30 minutes, and took CPU from the runs after it: ``ps`` after a
    ``make bench`` found three at 3 % CPU each, and the next runs' step rates fell by several per cent.
    """
    deadline = time.monotonic() + timeout
    while pids := leftover_workers(root):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers {pids} of {root} survived SIGKILL for {timeout:.0f}s")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def run_once(config: str, fail: bool, horizon: float, kill_every: float, seed: int, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True)
    rng = random.Random(seed)
    kills: list[dict[str, Any]] = []
    log = (root / "job.log").open("wb")
    t0 = time.time()
    job = subprocess.Popen(
        command(config, root), cwd=REPO, env=bench_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        next_kill = kill_every
        while (now := time.time() - t0) < horizon:
            if job.poll() is not None:
                raise RuntimeError(f"{config}: the job exited early ({job.returncode}); see {root / 'job.log'}")
            if fail and now >= next_kill:
                kill = kill_one(root, config, rng)
                if kill is not None:
                    kill["at"] = kill["time"] - t0
                    kills.append(kill)
                next_kill += kill_every
            time.sleep(0.05)
    finally:
        job.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=15)
        # workers that outlived their launcher (Lightning catches SIGTERM) must not load the next run
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        kill_leftover_workers(root)
        log.close()
    result = analyse(config, root, t0, t0 + horizon, kills)
    label = "with failures" if fail else "no failures"
    print(f"  {config:12s} {label:13s}: {result['steps']:6d} steps, {len(kills)} kills", flush=True)
    return {"config": config, "fail": fail, "seed": seed, "kills": kills, **result}


def step_records(root: Path, prefix: str) -> list[tuple[float, int, int, int, str, int]]:
    """(time, step, samples, participants, who, pid) of every committed step, in time order."""
    records = []
    for path in (root / "steps").glob(f"{prefix}*.txt"):
        who, pid = path.stem.split(".")
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) == 4:
                records.append((float(fields[0]), int(fields[1]), int(fields[2]), int(fields[3]), who, int(pid)))
    return sorted(records)


def analyse(config: str, root: Path, t0: float, end: float, kills: list[dict[str, Any]]) -> dict[str, Any]:
    prefix = "group" if config == "ft" else "rank0"
    records = [r for r in step_records(root, prefix) if r[0] <= end]
    if not records:
        raise RuntimeError(f"{config}: no step was committed; see {root / 'job.log'}")
    if config == "ft":
        steps, samples = max(r[1] for r in records), max(r[2] for r in records)
    else:  # the state the job holds at the horizon: the latest incarnation's latest step
        steps = records[-1][1]
        samples = steps * WORLD * BATCH
    first_step = records[0][0] - t0
    recoveries = [recovery(config, root, records, kill) for kill in kills]
    return {"steps": steps, "samples": samples, "first_step_s": first_step, "recoveries": recoveries}


def timeline(root: Path, who: str, after: float) -> dict[str, float] | None:
    """The first process of ``who`` that started after ``after`` (a restart)."""
    starts = []
    for path in (root / "timeline").glob(f"{who}.*.json"):
        record = json.loads(path.read_text())
        if record["exec"] > after:
            starts.append(record)
    return min(starts, key=lambda r: r["exec"]) if starts else None


def recovery(config: str, root: Path, records: list[tuple], kill: dict[str, Any]) -> dict[str, Any]:
    at = kill["time"]
    if config != "ft":
        before = [r for r in records if r[0] <= at]
        after = [r for r in records if r[0] > at and r[5] != before[-1][5]] if before else []
        pre_kill = before[-1][1] if before else 0
        passed = next((r[0] for r in after if r[1] > pre_kill), None)
        return {
            "victim": kill["victim"],
            "pre_kill_step": pre_kill,
            "resumed_step": after[0][1] - 1 if after else None,
            "lost_steps": pre_kill - (after[0][1] - 1) if after else None,
            "kill_to_first_step_s": after[0][0] - at if after else None,
            "kill_to_passes_pre_kill_step_s": passed - at if passed else None,
        }
    victim = f"group{kill['victim']}"
    survivors = [r for r in records if r[0] > at and r[4] != victim and r[3] < WORLD]
    restarted = [r for r in records if r[0] > at and r[4] == victim and r[5] != kill["pid"]]
    started = timeline(root, victim, at)
    healed = [
        e
        for e in read_events(root / "events")
        if e["event"] == "healed" and e.get("group") == kill["victim"] and e["time"] > at
    ]
    out: dict[str, Any] = {
        "victim": kill["victim"],
        "kill_to_survivors_commit_s": survivors[0][0] - at if survivors else None,
        "kill_to_restarted_commit_s": restarted[0][0] - at if restarted else None,
    }
    if started is not None and restarted:
        out.update(
            respawn_s=started["exec"] - at,
            import_s=started["imported"] - started["exec"],
            setup_s=started["train_start"] - started["imported"],
            first_step_s=restarted[0][0] - started["train_start"],
            heal_s=healed[0]["seconds"] if healed else None,
            restart_to_first_commit_s=restarted[0][0] - started["exec"],
        )
    return out


def model_inputs(runs: list[dict[str, Any]], restarts: list[str], horizon: float) -> dict[str, float]:
    """The measured costs that ``cluster_model.py`` scales up: the step-time ratio of failure-free training, the
    restart baseline's time from a kill to its first step again (its lost work is modelled from the checkpoint
    interval), the survivors' stall, and the killed group's time out (kill to its first commit).

    The step-time ratio compares steps per second *after each run's first step*: start-up happens once per job, so
    it belongs to neither side's per-step cost (over this benchmark's short horizon it is several per cent)."""

    def costs(config: str, key: str) -> list[float]:
        recs = [rec for r in runs if r["config"] == config and r["fail"] for rec in r["recoveries"]]
        return [rec[key] for rec in recs if rec.get(key) is not None]

    def steady_rate(config: str) -> float:  # failure-free steps per second after the first step, median of runs
        clean = [r for r in runs if r["config"] == config and not r["fail"]]
        return median([r["steps"] / (horizon - r["first_step_s"]) for r in clean])

    restart_rate = max((steady_rate(c) for c in restarts), default=float("nan"))
    return {
        # the restart baseline's failure-free step rate ÷ ft's
        "step_time_ratio": restart_rate / steady_rate("ft"),
        "restart_a_s": median([v for c in restarts for v in costs(c, "kill_to_first_step_s")]),
        "stall_s": median(costs("ft", "kill_to_survivors_commit_s")),
        "restart_heal_s": median(costs("ft", "kill_to_restarted_commit_s")),
    }


def summarise(runs: list[dict[str, Any]], configs: list[str], horizon: float) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for config in configs:
        reps = sorted({r["seed"] for r in runs if r["config"] == config})
        goodput, goodput_samples, absolute = [], [], []
        for seed in reps:
            fail = next(r for r in runs if r["config"] == config and r["seed"] == seed and r["fail"])
            clean = next(r for r in runs if r["config"] == config and r["seed"] == seed and not r["fail"])
            baselines = [r for r in runs if r["config"] != "ft" and r["seed"] == seed and not r["fail"]]
            base = max(b["steps"] for b in baselines) if baselines else float("nan")
            goodput.append(fail["steps"] / clean["steps"])
            goodput_samples.append(fail["samples"] / clean["samples"])
            absolute.append(fail["steps"] / base)
        clean_steps = [r["steps"] for r in runs if r["config"] == config and not r["fail"]]
        table[config] = {
            "goodput_steps": median(goodput),
            "goodput_samples": median(goodput_samples),
            "absolute_progress": median(absolute),
            "per_rep_goodput": goodput,
            "per_rep_absolute": absolute,
            "failure_free_steps": median(clean_steps),
        }
    restarts = [c for c in configs if c != "ft"]
    table["model_inputs"] = model_inputs(runs, restarts, horizon)
    if "ft" in table and restarts:
        best = max(table[c]["absolute_progress"] for c in restarts)
        table["ft"]["absolute_vs_best_restart"] = table["ft"]["absolute_progress"] / best
    recoveries = [rec for r in runs if r["config"] == "ft" and r["fail"] for rec in r["recoveries"]]
    keys = sorted({k for rec in recoveries for k in rec if k.endswith("_s")})
    table["ft_recovery_median"] = {k: median([rec[k] for rec in recoveries if rec.get(k) is not None]) for k in keys}
    for config in restarts:
        recs = [rec for r in runs if r["config"] == config and r["fail"] for rec in r["recoveries"]]
        keys = sorted({k for rec in recs for k in rec if k.endswith("_s") or k == "lost_steps"})
        table[f"{config}_recovery_median"] = {
            k: median([rec[k] for rec in recs if rec.get(k) is not None]) for k in keys
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horizon", type=float, default=105.0, help="seconds from launch (default: %(default)s)")
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument(
        "--every", type=int, nargs="*", default=[50], help="checkpoint intervals of the baseline (none: ft only)"
    )
    parser.add_argument(
        "--launch-arg", action="append", default=[], help="an extra `lightning-ft launch` option for the ft side"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--out",
        type=Path,
        help="a new file (default: results/goodput/<UTC>_<commit>.json); with --summarise-only, the file to recompute",
    )
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep every run's logs under this directory")
    parser.add_argument(
        "--summarise-only", action="store_true", help="recompute the summary of the runs already in --out; run nothing"
    )
    args = parser.parse_args()
    if args.summarise_only:
        if args.out is None:
            parser.error("--summarise-only needs --out, the results file to recompute")
        results = json.loads(args.out.read_text())
        configs = list(dict.fromkeys(run["config"] for run in results["runs"]))
        results["summary"] = summarise(results["runs"], configs, results["settings"]["horizon_s"])
        args.out.write_text(json.dumps(results, indent=1))
        print(f"rewrote the summary of {args.out}")
        return
    args.out = new_results_file("goodput", args.out, args.label)
    LAUNCH_ARGS.extend(args.launch_arg)
    configs = [f"restart-{every}" for every in args.every] + ["ft"]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lightning-ft-goodput-") as temporary:
        scratch = args.keep or temporary
        for seed in range(args.repeats):
            order = configs if seed % 2 == 0 else list(reversed(configs))  # cancel drift between repetitions
            for config in order:
                for fail in (False, True):
                    root = Path(scratch) / f"{config}-{seed}-{'fail' if fail else 'clean'}"
                    runs.append(run_once(config, fail, args.horizon, args.kill_every, seed, root))
    summary = summarise(runs, configs, args.horizon)
    print(json.dumps(summary, indent=1))
    settings = {
        "horizon_s": args.horizon,
        "kill_every_s": args.kill_every,
        "workers": WORLD,
        "batch": BATCH,
        "launch_args": args.launch_arg,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header(), "settings": settings, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The CPU that torchft's per-step protocol itself takes, with no model: a floor under the zoo's fixed cost (issue 25).

Each step of a torchft job asks the lighthouse for a quorum (through the group's Manager server), votes
(``should_commit``, through the Manager server again) and sends its gradients through the Manager's allreduce. On a
machine whose cores all train, every CPU-millisecond of that, on whichever thread or process, comes out of training.
This measures it alone, side by side with what ``DDPStrategy`` needs per step at the least (one allreduce):

* ``ddp``: ``torchrun --nproc-per-node 2``, a Gloo world of 2; each step is one allreduce of one float.
* ``torchft``: ``lightning-ft launch --replica-groups 2`` (2 groups of 1 process, the embedded lighthouse), raw
  torchft 0.2.0 as its README loop drives it: ``start_quorum`` (asynchronous), ``Manager.allreduce`` of one float,
  ``should_commit``. No Lightning and no lightning-ft code runs in the workers.
* ``quorum_vote``: the same without any allreduce: ``start_quorum``, ``wait_quorum``, ``should_commit``. This is
  the protocol that no implementation on torchft 0.2.0 avoids: a lighthouse round trip and a vote, both through the
  group's Manager server. Its whole CPU is extra (``ddp``'s one allreduce stands for the gradient exchange, which
  ``FTStrategy`` pays like ``DDPStrategy``).

Each process reports its own CPU time (every thread) over a window of steps after a warm-up; the torchrun agents'
and the launcher's (the lighthouse's) CPU over the same window are read from ``/proc``. The extra CPU per step of the
whole job, spread over the machine's 2 cores, is what a CPU-bound step on both cores pays at the least:
``floor ratio = 1 + extra / 2 / step``, printed for the zoo rows' ``DDPStrategy`` step times.

Usage: ``python -m benchmarks.zoo.protocol_floor [--steps 2000] [--repetitions 3]``; results in
``benchmarks/results/protocol_floor/<UTC>_<commit>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import LIGHTNING_FT, bench_env, module_command, raw_torchft_manager, run_job

WARMUP_STEPS = 200
MODES = ("ddp", "torchft", "quorum_vote")
ZOO_STEPS_MS = {"mlp-0.3m": 12.0, "mlp-1m": 27.1, "cnn-0.3m": 35.1, "transformer-1m": 57.3}  # DDPStrategy's, section 6


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of process ``pid`` so far (every thread), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def worker(mode: str, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    if mode == "ddp":
        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def step() -> None:
            dist.all_reduce(value)

    else:
        rank = int(os.environ["REPLICA_GROUP_ID"])
        manager = raw_torchft_manager(f"protocol_floor_{rank}", state_dict=dict, load_state_dict=lambda state: None)

        def step() -> None:
            manager.start_quorum()
            if mode == "torchft":
                manager.allreduce(value).wait()
            else:
                manager.wait_quorum()
            manager.should_commit()

    agent = os.getppid()
    watched = {"agent": agent} | ({"launcher": parent_of(agent)} if mode != "ddp" and rank == 0 else {})
    for _ in range(WARMUP_STEPS):
        step()
    before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    others = {name: cpu_seconds(pid) - before[name] for name, pid in watched.items()}
    if mode == "ddp" and rank != 0:
        others.pop("agent")  # one agent for the world: counted once, by rank 0
    out.joinpath(f"{mode}.{rank}.json").write_text(json.dumps({"cpu_s": cpu, "wall_s": wall, "others_cpu_s": others}))
    if mode == "ddp":
        dist.destroy_process_group()
    else:
        manager.shutdown(wait=False)


def run_once(mode: str, steps: int, scratch: Path) -> dict[str, float]:
    """One job of ``mode``: wall time per step, and the whole job's CPU per step (workers, agents, launcher)."""
    out = scratch / mode
    out.mkdir(parents=True)
    command = module_command(__spec__.name, "--worker", mode, "--steps", str(steps), "--out", str(out))
    if mode == "ddp":
        job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python"]
    else:
        job = [*LIGHTNING_FT, "launch", "--replica-groups", "2", "--"]
    if run_job(job + command, scratch / f"{mode}.log", timeout=600, env=bench_env()) != 0:
        raise SystemExit(f"{mode} failed; see {scratch / f'{mode}.log'}")
    reports = [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]
    job_cpu = sum(r["cpu_s"] + sum(r["others_cpu_s"].values()) for r in reports)
    return {
        "wall_ms_per_step": 1e3 * statistics.mean(r["wall_s"] for r in reports) / steps,
        "job_cpu_ms_per_step": 1e3 * job_cpu / steps,
        "workers_cpu_ms_per_step": 1e3 * sum(r["cpu_s"] for r in reports) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="worker: report directory; driver: results file")
    parser.add_argument("--steps", type=int, default=2000, help="steps in each measured window (default: 2000)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    results = new_results_file("protocol_floor", args.out, args.label)
    runs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="protocol-floor-") as scratch:
        for repetition in range(args.repetitions):
            order = MODES if repetition % 2 == 0 else MODES[::-1]
            runs.append({mode: run_once(mode, args.steps, Path(scratch) / f"{repetition}") for mode in order})
            print(json.dumps(runs[-1]), flush=True)
    record: dict[str, object] = {"steps": args.steps, "runs": runs}
    for mode, baseline in (("torchft", "ddp"), ("quorum_vote", None)):
        extra = statistics.median(
            r[mode]["job_cpu_ms_per_step"] - (r[baseline]["job_cpu_ms_per_step"] if baseline else 0.0) for r in runs
        )
        floors = {model: round(1 + extra / 2 / step_ms, 3) for model, step_ms in ZOO_STEPS_MS.items()}
        record[mode] = {"extra_job_cpu_ms_per_step": extra, "floor_ratio": floors}
        print(f"{mode}: +{extra:.2f} ms of the job's CPU per step; floor ratios {floors}")
    results.write_text(json.dumps(record | header(), indent=1) + "\n")
    print(results)


if __name__ == "__main__":
    main()

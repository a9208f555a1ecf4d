"""The CPU one cross-group allreduce costs, per layer of the path a gradient bucket takes (issue 54).

Each DDP gradient bucket crosses replica groups as one allreduce, so this is the cost that a bucket more or less
per step adds or saves. Two processes on this machine allreduce one tensor many times, through each layer in turn:

* ``gloo``: torch's own Gloo process group (what ``DDPStrategy``'s DDP reduces through), the future waited for;
* ``torchft``: torchft's reconfigurable ``ProcessGroupGloo`` wrapper around it (a new Gloo group per quorum);
* ``lightning_ft``: lightning-ft's (``StoreCheckedProcessGroupGloo``): every operation handed out through the
  left-behind watch (``process_group/left_behind.py``);
* ``lightning_ft_hook``: the same with what the DDP hook chains to it: a completion callback that averages the
  bucket in place (``step/gradient_hooks.py``).

Two sizes: 1 KB (the fixed cost of an operation) and 1 MB (a 0.26 M-parameter model's gradients). A run's figure is
each process's CPU seconds (every thread of it: the caller, Gloo's worker and transport threads) and wall time per
operation, averaged over the two processes; variants run interleaved, ``--repeats`` times each, and a verdict is
the median over the repeats of each variant's ratio to ``gloo`` of the same repeat.

Usage: ``python -m benchmarks.zoo.collective_cost [--ops 3000] [--repeats 3]``; results in
``benchmarks/results/collective_cost/<UTC>_<commit>.json``, every run kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common.run_util import module_command, run_workers

VARIANTS = ("gloo", "torchft", "lightning_ft", "lightning_ft_hook")
SIZES = {"1KB": 256, "1MB": 262_912}  # float32 elements; 1 MB is the 0.26 M-parameter MLP's gradients
TIMEOUT = timedelta(seconds=60)
WARMUP_OPS = 100


def worker(variant: str, numel: int, rank: int, port: int, ops: int) -> None:
    """Allreduce ``numel`` floats ``ops`` times with the other process; print this process's CPU and wall per op."""
    import torch
    import torch.distributed as dist

    from benchmarks.common.process_harness import reconfigure_without_manager

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    sum_op = dist.AllreduceOptions()
    sum_op.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    buffer = torch.ones(numel)
    if variant == "gloo":
        group: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, TIMEOUT)
    else:
        from torchft import ProcessGroupGloo

        from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo

        group = (ProcessGroupGloo if variant == "torchft" else StoreCheckedProcessGroupGloo)(timeout=TIMEOUT)
        reconfigure_without_manager(group, f"127.0.0.1:{port}", rank, 2, quorum_id=1)

    def average(done: torch.futures.Future[Any]) -> torch.Tensor:
        done.value()
        buffer.mul_(0.5)
        return buffer

    def one() -> None:
        future = group.allreduce([buffer], sum_op).get_future()
        if variant == "lightning_ft_hook":
            future = future.then(average)
        future.wait()

    for _ in range(WARMUP_OPS):
        one()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(ops):
        one()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(json.dumps({"cpu_us_per_op": 1e6 * cpu / ops, "wall_us_per_op": 1e6 * wall / ops}), flush=True)
    store.set(f"finished/{rank}", "1")  # neither process tears its groups down while the other still reduces
    store.wait([f"finished/{1 - rank}"])


def run_variant(variant: str, size: str, ops: int) -> dict[str, float]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = module_command(__spec__.name, "--worker", variant, "--size", size, "--port", str(store.port))
    outputs = run_workers(
        [[*command, "--rank", str(rank), "--ops", str(ops)] for rank in range(2)], f"{variant} {size}"
    )
    rows = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    return {key: statistics.mean(row[key] for row in rows) for key in ("cpu_us_per_op", "wall_us_per_op")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3, help="each variant this many times, interleaved")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--size", choices=tuple(SIZES), default="1KB")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a new file (default: results/collective_cost/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, SIZES[args.size], args.rank, args.port, args.ops)
        return

    from benchmarks.common.results import header, new_results_file

    out = new_results_file("collective_cost", args.out, args.label)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for size in SIZES:
            for variant in VARIANTS:
                figures = run_variant(variant, size, args.ops)
                runs.append({"variant": variant, "size": size, "repeat": repeat, **figures})
                print(
                    f"{size:>4} {variant:>17} #{repeat}: CPU {figures['cpu_us_per_op']:7.1f} us/op per process, "
                    f"wall {figures['wall_us_per_op']:7.1f} us/op",
                    flush=True,
                )
    verdict: dict[str, dict[str, Any]] = {}
    for size in SIZES:
        for variant in VARIANTS:
            ratios, extra = [], []
            for repeat in range(args.repeats):
                [mine] = [r for r in runs if (r["variant"], r["size"], r["repeat"]) == (variant, size, repeat)]
                [base] = [r for r in runs if (r["variant"], r["size"], r["repeat"]) == ("gloo", size, repeat)]
                ratios.append(mine["cpu_us_per_op"] / base["cpu_us_per_op"])
                extra.append(mine["cpu_us_per_op"] - base["cpu_us_per_op"])
            verdict.setdefault(size, {})[variant] = {
                "cpu_ratio_to_gloo_median": round(statistics.median(ratios), 3),
                "cpu_extra_us_median": round(statistics.median(extra), 1),
                "cpu_ratios": [round(r, 3) for r in ratios],
            }
    for size, variants in verdict.items():
        print(
            size,
            {variant: (v["cpu_ratio_to_gloo_median"], v["cpu_extra_us_median"]) for variant, v in variants.items()},
        )
    out.write_text(json.dumps({**header(), "ops": args.ops, "runs": runs, "verdict": verdict}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

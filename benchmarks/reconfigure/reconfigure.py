"""How long the cross-group process group takes to reconfigure for a new quorum, and its first allreduce after that:
torchft's wrapper group (a new Gloo group per quorum), lightning-ft's (the same, with its safeguards before the
rendezvous), and torch's native reconfigurable Gloo group (torch >= 2.14 with torchft's reconfigure API).

The question (issue 39): would native groups make a heal or a rejoin faster? A rejoin is a quorum, this
reconfiguration and the heal's transfer; only the reconfiguration differs between the variants, so that is what is
timed, the same way for each: every rank calls torchft's ``reconfigure_with_store`` on a fresh prefix of one
TCPStore, ``generations`` times, and then allreduces one small tensor. Each variant runs as ``world`` processes of
their own; the figures are rank 0's medians over the generations after the first, with the count of generations over
1 s and of those given up (lightning-ft's arrival wait gives a quorum up when a member is over 1 s late).

On this machine every 25th TCPStore client a process opens takes 5 s to connect (torch 2.13 and 2.15, with either
server backend; plain sockets do not), which every variant that opens a store client per reconfiguration meets: a
reverse DNS lookup of the peer's address (client and server alike) that this machine's resolver leaves unanswered
about once in 25 clients waits out the resolver's 5-s timeout (docs/compatibility.md).

Needs torch >= 2.14 and torchft's reconfigure API, for example::

    pip install --no-deps --target /tmp/torchft-next torchft-nightly==2026.10.26
    PYTHONPATH=/tmp/torchft-next .venv-torch-2.15/bin/python -m benchmarks.reconfigure.reconfigure

Results go to ``benchmarks/results/reconfigure/<UTC>_<commit>.json``; every run is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common.run_util import module_command, run_workers

VARIANTS = ("torchft", "lightning_ft", "native")
TIMEOUT = timedelta(seconds=60)


def build(variant: str, store: Any, rank: int, world: int) -> Any:
    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    if variant == "torchft":
        return ProcessGroupGloo(timeout=TIMEOUT)
    if variant == "lightning_ft":
        from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo

        return StoreCheckedProcessGroupGloo(timeout=TIMEOUT)
    # torch's native group: built once on a bootstrap store shared by every member, with distinct initial ranks.
    bootstrap = dist.PrefixStore("native/bootstrap", store)
    backend = dist.ProcessGroupGloo(bootstrap, rank, world, TIMEOUT, enable_reconfigure=True)
    group = dist.ProcessGroup(bootstrap, rank, world)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def worker(variant: str, rank: int, world: int, port: int, generations: int) -> None:
    import torch
    import torch.distributed as dist
    from torchft.process_group import reconfigure_with_store

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    group = build(variant, store, rank, world)
    for generation in range(generations):
        started = time.perf_counter()
        try:
            reconfigure_with_store(group, f"127.0.0.1:{port}/{variant}/{generation}", rank, world, TIMEOUT)
        except Exception as error:  # lightning-ft's arrival wait gives a quorum up; the next generation is a new one
            if rank == 0:
                print(json.dumps({"failed": type(error).__name__, "seconds": time.perf_counter() - started}))
            continue
        reconfigured = time.perf_counter()
        tensor = torch.ones(1024)
        group.allreduce([tensor], dist.AllreduceOptions()).wait()
        reduced = time.perf_counter()
        assert float(tensor[0]) == world, tensor[0]
        if rank == 0:
            print(json.dumps({"reconfigure_s": reconfigured - started, "first_allreduce_s": reduced - reconfigured}))
    sys.stdout.flush()


def run_variant(variant: str, world: int, generations: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = module_command(__spec__.name, "--worker", variant, "--world", str(world), "--port", str(store.port))
    outputs = run_workers(
        [[*command, "--rank", str(rank), "--generations", str(generations)] for rank in range(world)], variant
    )
    rows = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    later = [row for row in rows[1:] if "failed" not in row]  # the first generation also warms up
    return {
        "generations": len(rows),
        "failed": sum("failed" in row for row in rows),
        "over_1s": sum(row.get("reconfigure_s", 0.0) > 1.0 for row in rows),
        "reconfigure_s_median": statistics.median(r["reconfigure_s"] for r in later),
        "first_allreduce_s_median": statistics.median(r["first_allreduce_s"] for r in later),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--generations", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="each variant this many times, interleaved")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a new file (default: results/reconfigure/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rank, args.world, args.port, args.generations)
        return

    import torch
    import torchft

    from benchmarks.common.results import header, new_results_file
    from lightning_ft.process_group.torchft_api import RECONFIGURE_API

    out = new_results_file("reconfigure", args.out, args.label)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            result = run_variant(variant, args.world, args.generations)
            runs.append({"variant": variant, "repeat": repeat, **result})
            print(
                f"{variant:>12} #{repeat}: reconfigure {1000 * result['reconfigure_s_median']:.1f} ms, first allreduce "
                f"{1000 * result['first_allreduce_s_median']:.2f} ms (medians of {result['generations'] - 1}); "
                f"{result['over_1s']} over 1 s, {result['failed']} given up",
                flush=True,
            )
    verdict = {}
    for variant in VARIANTS:
        mine = [r["reconfigure_s_median"] for r in runs if r["variant"] == variant]
        base = [r["reconfigure_s_median"] for r in runs if r["variant"] == "torchft"]
        verdict[variant] = [round(m / b, 3) for m, b in zip(mine, base, strict=True)]
    print("reconfigure time against torchft's wrapper, per repeat:", verdict)
    out.write_text(
        json.dumps(
            {
                **header(),
                "torch": torch.__version__,
                "torchft_imported": {"path": torchft.__file__, "reconfigure_api": RECONFIGURE_API},
                "world": args.world,
                "runs": runs,
                "ratio_to_torchft": verdict,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

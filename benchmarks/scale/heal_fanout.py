"""Heal fan-out: k replica groups healing at the same moment, all from one live peer or each from its own.

When several groups restart together they heal in the same quorum, and torchft's quorum picks each one's source
(``compute_quorum_results``: round robin over the up-to-date replicas). This benchmark measures what that choice is
worth: k receivers fetch the same training state at the same moment over lightning-ft's heal transport
(:class:`lightning_ft.manager.http_transport.CheckpointHTTPTransport` on loopback, as a loopback group builds it),

* ``one``: all k from one sender (every heal from group 0, what torchft does when the victims come back in
  different quorums);
* ``spread``: receiver i from sender i, k senders (the round robin of one quorum, with at least k live groups);

for k = 1, 2, 4, against k = 1 (a lone heal). Real processes, one compute thread each: up to 4 senders and 4
receivers started once, meeting through a TCPStore that this driver hosts on a free loopback port. A round's
receivers wait for each other (every receiver's ``ready`` key), then each times ``recv_checkpoint`` from call to
return and checks every received tensor (``torch.equal``, outside the timing). A round's figure is the time until the
last of its k heals has returned (the job runs short of k groups until then) and each receiver's own time. The state
is ``heal_throughput.py``'s (``common/heal_state.py``): float32 tensors of 4 MB, every element distinct.

On this machine the processes share 2 cores, so k heals at once compete for the CPU whatever their sources: the
comparison shows whether one source is the bottleneck beyond that. Usage::

    python -m benchmarks.scale.heal_fanout                # 100 MB, k = 1, 2, 4, 3 repetitions: about 1 minute
    python -m benchmarks.scale.heal_fanout --size 20 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.heal_state import MB, check, make_state
from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import median, module_command, run_together

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=120)  # every transport call and store wait in a child
LAYOUTS = ("one", "spread")


def rounds(fanouts: list[int], repeats: int) -> list[tuple[str, int, int]]:
    """(layout, k, repetition) in the order every process runs them; a lone heal is one layout's k = 1."""
    order = []
    for rep in range(repeats):
        for k in fanouts:
            for layout in LAYOUTS if k > 1 else ("one",):
                order.append((layout, k, rep))
    return order


def source_of(layout: str, receiver: int) -> int:
    return 0 if layout == "one" else receiver


# --- the child processes ----------------------------------------------------------------------------------------


def run_sender(index: int, size_bytes: int, plan: list[tuple[str, int, int]], store: torch.distributed.Store) -> None:
    from lightning_ft.manager.http_transport import CheckpointHTTPTransport

    transport = CheckpointHTTPTransport(HOST, timeout=TIMEOUT)
    try:
        state = make_state(size_bytes)
        store.set(f"address/{index}", transport.metadata())
        for step, (layout, k, _) in enumerate(plan, start=1):
            mine = [i for i in range(k) if source_of(layout, i) == index]
            if not mine:
                continue
            transport.send_checkpoint(mine, step, state, TIMEOUT)  # stages the state; the receivers fetch it
            store.set(f"staged/{step}/{index}", "1")
            store.wait([f"done/{step}/{i}" for i in mine], TIMEOUT)
            transport.disallow_checkpoint()
    finally:
        transport.shutdown(wait=False)


def run_receiver(
    index: int, size_bytes: int, plan: list[tuple[str, int, int]], store: torch.distributed.Store, result: Path
) -> None:
    from lightning_ft.manager.http_transport import CheckpointHTTPTransport

    transport = CheckpointHTTPTransport(HOST, timeout=TIMEOUT)
    records: list[dict[str, Any]] = []
    try:
        expected = make_state(size_bytes)
        for step, (layout, k, rep) in enumerate(plan, start=1):
            if index >= k:
                continue
            source = source_of(layout, index)
            store.wait([f"staged/{step}/{source}"], TIMEOUT)
            address = store.get(f"address/{source}").decode()
            store.set(f"ready/{step}/{index}", "1")
            store.wait([f"ready/{step}/{i}" for i in range(k)], TIMEOUT)  # all k heals start together
            started = time.perf_counter()
            received = transport.recv_checkpoint(source, address, step, TIMEOUT)
            ended = time.perf_counter()
            check(received, expected, None)
            del received
            store.set(f"done/{step}/{index}", "1")
            records.append({"layout": layout, "k": k, "rep": rep, "started": started, "ended": ended})
        result.write_text(json.dumps(records))
    finally:
        transport.shutdown(wait=False)


def child(args: argparse.Namespace) -> None:
    store = torch.distributed.TCPStore(HOST, args.store_port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    plan = rounds(args.fanouts, args.repeats)
    size_bytes = args.size * MB
    if args.role == "sender":
        run_sender(args.index, size_bytes, plan, store)
    else:
        run_receiver(args.index, size_bytes, plan, store, args.result)


# --- the driver -------------------------------------------------------------------------------------------------


def run_children(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """Start the senders and receivers, wait for all, stop any left over (ours alone, each in its own session)."""
    from lightning_ft.manager.listeners import group_store

    store = group_store(HOST)  # on loopback only, on a free port
    width = max(args.fanouts)
    limit = 120.0 + 2.0 * len(rounds(args.fanouts, args.repeats)) * width * args.size / 100
    commands = []
    for role, index in [("sender", i) for i in range(width)] + [("receiver", i) for i in range(width)]:
        command = module_command(__spec__.name, f"--role={role}", f"--index={index}")
        command += [f"--size={args.size}", f"--repeats={args.repeats}", f"--store-port={store.port}"]
        command += [f"--result={scratch / f'receiver{index}.json'}", "--fanouts", *map(str, args.fanouts)]
        commands.append((command, scratch / f"{role}{index}.log"))
    try:
        run_together(commands, limit)
    finally:
        del store
    return [record for i in range(width) for record in json.loads((scratch / f"receiver{i}.json").read_text())]


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (layout, k): each repetition's time until the last heal returned, and every receiver's own time."""
    rows = []
    for layout, k in sorted({(r["layout"], r["k"]) for r in records}, key=lambda lk: (lk[1], lk[0])):
        mine = [r for r in records if r["layout"] == layout and r["k"] == k]
        reps = sorted({r["rep"] for r in mine})
        all_healed = [
            max(r["ended"] for r in mine if r["rep"] == rep) - min(r["started"] for r in mine if r["rep"] == rep)
            for rep in reps
        ]
        each = [r["ended"] - r["started"] for r in mine]
        rows.append(
            {
                "layout": layout,
                "k": k,
                "all_healed_s": [round(s, 4) for s in all_healed],
                "all_healed_median_s": round(median(all_healed), 4),
                "each_median_s": round(median(each), 4),
            }
        )
    lone = next(row["all_healed_median_s"] for row in rows if row["k"] == 1)
    for row in rows:
        row["against_one_heal"] = round(row["all_healed_median_s"] / lone, 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=100, help="the state's size in MB (1e6 bytes)")
    parser.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 4], help="k, the heals at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="a new file (default: results/heal_fanout/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument("--role", choices=("driver", "sender", "receiver"), default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role != "driver":
        child(args)
        return
    if 1 not in args.fanouts or min(args.fanouts) < 1 or args.size < 1 or args.repeats < 1:
        parser.error("--fanouts must include 1 (the lone heal every row is compared with); sizes and repeats > 0")
    args.out = new_results_file("heal_fanout", args.out, args.label)
    with tempfile.TemporaryDirectory(prefix="lightning-ft-fanout-") as scratch:
        records = run_children(args, Path(scratch))
    rows = summarise(records)
    print("| k | sources | until every heal returned, each repetition | median | against one heal | a heal's own |")
    print("|---:|---|---|---:|---:|---:|")
    for row in rows:
        reps = ", ".join(f"{s:.3f}" for s in row["all_healed_s"])
        sources = "1" if row["layout"] == "one" else str(row["k"])
        print(
            f"| {row['k']} | {sources} | {reps} s | {row['all_healed_median_s']:.3f} s | "
            f"{row['against_one_heal']:.2f}× | {row['each_median_s']:.3f} s |"
        )
    settings = {"size_mb": args.size, "fanouts": args.fanouts, "repeats": args.repeats, "omp_num_threads": 1}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header(), "settings": settings, "rows": rows, "records": records}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

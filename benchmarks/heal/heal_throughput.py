"""Heal throughput: how fast a healing replica group receives a live peer's training state, by state size and transport.

A group that rejoins a job fetches the whole training state from a live peer before it trains again, so the heal
transport's throughput bounds how long the job runs a replica short after a restart. The project's target is at
least 1 GB/s on loopback (1 GB = 1e9 bytes). Transports measured, each as lightning-ft builds it
(:func:`lightning_ft.manager.checkpoint_transport` for a group that advertises loopback):

* ``http``: :class:`lightning_ft.manager.http_transport.CheckpointHTTPTransport`, torchft's HTTP transport loading with
  ``weights_only=True``, served on 127.0.0.1, unchunked (``num_chunks=0``, as the Manager builds it);
* ``pg``: torchft's ``PGTransport`` over torchft's reconfigurable Gloo process group
  (:class:`lightning_ft.manager.listeners.AddressedProcessGroupGloo` bound to 127.0.0.1), received into new tensors, as
  lightning-ft configures it;
* ``pg-inplace``: the same, with PGTransport's ``state_dict`` callback, so the tensors are received into the
  receiver's existing (already resident) tensors. lightning-ft does not use this mode; it is here for comparison.

Two real processes on this machine, a sender and a receiver (1 compute thread each, as the training jobs run), meet
through a TCPStore that this driver hosts on a free loopback port, and run every configuration in turn over the same
HTTP server and Gloo process group. The state is a flat dict of float32 tensors of 4 MB each (1 MB = 1e6 bytes; the
last may be smaller) whose elements are all distinct (bit patterns counting up from 1.0), so a tensor received into
the wrong place fails the check. Per repetition both processes meet at a barrier, the sender offers the state
(``send_checkpoint``), and the receiver times ``recv_checkpoint`` from call to return: the wire transfer, the memory
the received state lands in, deserialisation and, for ``pg``, the sender's preparation (metadata pickling), which a
healing group waits for too. The received tensors are then compared with the sent ones (``torch.equal``, outside the
timing). The figure of a configuration is the median over repetitions. Every repetition is reported: the first of a
configuration is the coldest (memory new to the process, as in a real heal, which happens once per process lifetime);
later ones may reuse memory the previous repetition freed. The receiver's CPU time during the receive is recorded too:
close to the wall time, the receiver is the bottleneck; far below it, the receiver waits for the wire or the sender
(or, on a busy machine, for a core).

Usage::

    python -m benchmarks.heal.heal_throughput      # 100 MB and 1 GB, 3 repetitions (about 1 minute), a new results file
    python -m benchmarks.heal.heal_throughput --sizes 100 --repeats 5 --transports http
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

from benchmarks.common.heal_state import MAX_BYTES, MB, TENSOR_BYTES, check, make_state, state_bytes
from benchmarks.common.results import header, new_results_file
from benchmarks.common.run_util import median, module_command, run_together

TRANSPORTS = ("http", "pg", "pg-inplace")
HOST = "127.0.0.1"
GB = 1e9
TARGET_GB_PER_S = 1.0
TIMEOUT = timedelta(seconds=60)  # every transport call and store wait in a child
SENDER, RECEIVER = 0, 1


# --- the two child processes ------------------------------------------------------------------------------------


def barrier(store: torch.distributed.Store, name: str, rank: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{1 - rank}"], TIMEOUT)


class Transports:
    """One process's transports, each built the first time a configuration needs it, as lightning-ft builds it for a
    loopback group. Every configuration of a run shares the HTTP server and the Gloo process group, as a healing group
    would over its lifetime."""

    def __init__(self, rank: int, store_port: int) -> None:
        self._rank = rank
        self._store_port = store_port
        self._http: Any = None
        self._pg: Any = None

    def get(self, kind: str, inplace: dict[str, torch.Tensor] | None = None) -> Any:
        if kind == "http":
            if self._http is None:
                from lightning_ft.manager.http_transport import CheckpointHTTPTransport

                self._http = CheckpointHTTPTransport(HOST, timeout=TIMEOUT)
            return self._http
        from torchft.checkpointing.pg_transport import PGTransport

        if self._pg is None:
            from lightning_ft.manager.listeners import AddressedProcessGroupGloo

            self._pg = AddressedProcessGroupGloo(HOST, timeout=TIMEOUT)
            self._pg.configure(
                f"{HOST}:{self._store_port}/pg", replica_id=str(self._rank), rank=self._rank, world_size=2
            )
            # Connect before anything is timed: a healing group's process group is configured at the quorum.
            self._pg.allreduce([torch.zeros(1)], torch.distributed.ReduceOp.SUM).wait(TIMEOUT)
        callback = (lambda: inplace) if inplace is not None else None
        return PGTransport(self._pg, timeout=TIMEOUT, device=torch.device("cpu"), state_dict=callback)

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown(wait=False)
        if self._pg is not None:
            self._pg.shutdown()


def parse_configs(texts: list[str]) -> list[tuple[str, int]]:
    return [(kind, int(size)) for kind, size in (text.split(":") for text in texts)]


def run_sender(
    configs: list[tuple[str, int]], repeats: int, store: torch.distributed.TCPStore, port: int, device: str = "cpu"
) -> None:
    transports = Transports(SENDER, port)
    state: dict[str, torch.Tensor] = {}
    try:
        for index, (kind, size_bytes) in enumerate(configs):
            if state_bytes(state) != size_bytes:
                state = {}  # free the last size's state first
                state = make_state(size_bytes, device)
            shared = torch.distributed.PrefixStore(f"config{index}", store)
            transport = transports.get(kind)
            if kind == "http":
                shared.set("address", transport.metadata())
            for rep in range(repeats):
                step = index * repeats + rep + 1  # never one the HTTP server served before
                if kind == "http":  # stages the state and serves it; the receiver fetches after the barrier
                    staging = time.perf_counter()
                    transport.send_checkpoint([RECEIVER], step, state, TIMEOUT)  # copies a device's state off it
                    shared.set(f"staged/{rep}", str(time.perf_counter() - staging))
                barrier(shared, f"go/{rep}", SENDER)
                if kind != "http":  # returns once every tensor is sent
                    transport.send_checkpoint([RECEIVER], step, state, TIMEOUT)
                shared.wait([f"checked/{rep}"], TIMEOUT)
                transport.disallow_checkpoint()
    finally:
        transports.shutdown()


def run_receiver(
    configs: list[tuple[str, int]],
    repeats: int,
    store: torch.distributed.TCPStore,
    port: int,
    result: Path,
    device: str = "cpu",
) -> None:
    transports = Transports(RECEIVER, port)
    expected: dict[str, torch.Tensor] = {}
    records: list[dict[str, Any]] = []
    try:
        for index, (kind, size_bytes) in enumerate(configs):
            if state_bytes(expected) != size_bytes:
                expected = {}  # free the last size's state first
                expected = make_state(size_bytes, device)
            inplace = {k: torch.zeros_like(t) for k, t in expected.items()} if kind == "pg-inplace" else None
            shared = torch.distributed.PrefixStore(f"config{index}", store)
            transport = transports.get(kind, inplace)
            metadata = shared.get("address").decode() if kind == "http" else transport.metadata()
            seconds: list[float] = []
            cpu_seconds: list[float] = []
            stage_seconds: list[float] = []
            for rep in range(repeats):
                if inplace is not None:  # a copy left from the last repetition must not pass the check
                    for tensor in inplace.values():
                        tensor.zero_()
                barrier(shared, f"go/{rep}", RECEIVER)
                wall, cpu = time.perf_counter(), time.process_time()
                received = transport.recv_checkpoint(SENDER, metadata, index * repeats + rep + 1, TIMEOUT)
                if device != "cpu":  # a heal ends with the state on the healer's device
                    received = {key: tensor.to(device) for key, tensor in received.items()}
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - wall)
                if kind == "http":
                    stage_seconds.append(float(shared.get(f"staged/{rep}").decode()))
                cpu_seconds.append(time.process_time() - cpu)
                check(received, expected, inplace)
                del received
                shared.set(f"checked/{rep}", "1")
            del inplace
            size = state_bytes(expected)
            records.append(
                {
                    "transport": kind,
                    "size_bytes": size,
                    "tensors": len(expected),
                    "seconds": seconds,
                    "cpu": cpu_seconds,
                    "sender_stage_s": stage_seconds,
                    "device": device,
                }
            )
            print(f"  {kind:10s} {size / MB:5.0f} MB: {[round(s, 3) for s in seconds]} s", flush=True)
            result.write_text(json.dumps(records))
    finally:
        transports.shutdown()


def child(args: argparse.Namespace) -> None:
    store = torch.distributed.TCPStore(HOST, args.store_port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    configs = parse_configs(args.configs)
    if args.role == "sender":
        run_sender(configs, args.repeats, store, args.store_port, args.device)
    else:
        run_receiver(configs, args.repeats, store, args.store_port, args.result, args.device)


# --- the driver -------------------------------------------------------------------------------------------------


def deadline_seconds(configs: list[tuple[str, int]], repeats: int) -> float:
    """Generous: start-up (slow on a loaded machine), then 20 s per GB moved (0.05 GB/s) plus the state's set-up."""
    return 120.0 + sum(size / GB * (20.0 * repeats + 10.0) for _, size in configs)


def run_pair(configs: list[tuple[str, int]], repeats: int, scratch: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """Start a sender and a receiver for every configuration, wait for both, stop any left over; the receiver's
    records."""
    from lightning_ft.manager.listeners import group_store

    result = scratch / "receiver.json"
    store = group_store(HOST)  # on loopback only, on a free port
    commands = []
    for role in ("sender", "receiver"):
        command = [
            *module_command(__spec__.name),
            f"--role={role}",
            f"--repeats={repeats}",
            f"--store-port={store.port}",
            f"--result={result}",
            f"--device={device}",
            "--configs",
            *(f"{kind}:{size}" for kind, size in configs),
        ]
        commands.append((command, scratch / f"{role}.log"))
    try:
        run_together(commands, deadline_seconds(configs, repeats))
    finally:
        del store
    return json.loads(result.read_text())


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    seconds = record["seconds"]
    middle = median(seconds)
    return {
        "transport": record["transport"],
        "size_bytes": record["size_bytes"],
        "tensors": record["tensors"],
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(middle, 4),
        "gb_per_s": round(record["size_bytes"] / middle / GB, 3),
        "receiver_cpu_s": [round(s, 4) for s in record["cpu"]],
        "sender_stage_s": [round(s, 4) for s in record.get("sender_stage_s", [])],
        "device": record.get("device", "cpu"),
        "meets_target": record["size_bytes"] / middle / GB >= TARGET_GB_PER_S,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| transport | state | tensors | seconds per repetition | median s | GB/s | receiver CPU s (median) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        reps = ", ".join(f"{s:.3f}" for s in row["seconds"])
        lines.append(
            f"| {row['transport']} | {row['size_bytes'] / MB:.0f} MB | {row['tensors']} | {reps} | "
            f"{row['median_s']:.3f} | {row['gb_per_s']:.2f} | {median(row['receiver_cpu_s']):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="state sizes in MB (1e6 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--out", type=Path, help="a new file (default: results/heal_throughput/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where both processes hold the state (cuda: http only)"
    )
    # How the driver starts its children.
    parser.add_argument("--role", choices=("driver", "sender", "receiver"), default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role != "driver":
        child(args)
        return
    args.out = new_results_file("heal_throughput", args.out, args.label)
    if args.device != "cpu" and args.transports != ["http"]:
        parser.error("--device cuda measures the HTTP transport only: add --transports http")
    if args.repeats < 1 or not all(0 < size * MB <= MAX_BYTES for size in args.sizes):
        parser.error(f"--repeats must be positive and every size in (0, {MAX_BYTES // MB}] MB")

    started = time.perf_counter()
    configs = [(kind, size * MB) for size in args.sizes for kind in args.transports]
    with tempfile.TemporaryDirectory(prefix="lightning-ft-heal-") as scratch:
        rows = [summarise(record) for record in run_pair(configs, args.repeats, Path(scratch), args.device)]
    total = time.perf_counter() - started
    print()
    print(table(rows))
    print(f"\n{len(rows)} configurations in {total:.0f} s; target {TARGET_GB_PER_S:g} GB/s (1 GB = 1e9 bytes)")
    report = {
        **header(),
        "settings": {
            "repeats": args.repeats,
            "device": args.device,
            "tensor_bytes": TENSOR_BYTES,
            "dtype": "float32",
            "host": HOST,
            "omp_num_threads": 1,
            "target_gb_per_s": TARGET_GB_PER_S,
        },
        "total_seconds": round(total, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

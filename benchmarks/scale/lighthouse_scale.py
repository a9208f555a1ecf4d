"""The lighthouse at up to 1,000 replica groups, simulated: quorum formation, heartbeat load, dropping dead groups.

No training process: torchft's own lighthouse (``torchft._torchft.LighthouseServer``, in a process of its own so that
its CPU time can be read from ``/proc``) and torchft's own ``LighthouseClient``, one request thread per simulated
group, as a group's Manager server makes them. Per N:

* **formation**: all N groups ask for a quorum at once; the time from the first request to the last answer, and how
  much of it is the lighthouse's answer fan-out (from the quorum's ``created`` stamp to the last answer);
* **heartbeats**: every group heartbeats at the Manager's default interval (100 ms) for a few seconds, from a pool of
  driver threads; the lighthouse's CPU time per heartbeat, and the rate the driver reached (on 2 cores the driver,
  not the lighthouse, is what limits it at 1,000 groups);
* **drop**: a quarter of the groups stop heartbeating (as if SIGKILLed) while the others ask for the next quorum; the
  time from the stop until they have a quorum without the dead, with ``lightning-ft launch``'s lighthouse settings
  (heartbeat timeout 1 s, join timeout 300 ms).

Usage::

    python -m benchmarks.scale.lighthouse_scale                # N = 10, 30, 100, 300, 1000: about 2 minutes
    python -m benchmarks.scale.lighthouse_scale --groups 100 1000 --label run2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every request at INFO: read when the module loads
os.environ.setdefault("TOKIO_WORKER_THREADS", "2")

from torchft._torchft import LighthouseClient

from benchmarks.common.results import header, new_results_file

CLIENTS = 16  # gRPC channels shared by the simulated groups (a request names its group: one channel serves many)
SERVE = """
import os, sys
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="127.0.0.1:0", min_replicas={min_replicas}, join_timeout_ms={join_timeout_ms},
                          quorum_tick_ms={quorum_tick_ms}, heartbeat_timeout_ms={heartbeat_timeout_ms})
print(server.address(), flush=True)
sys.stdin.read()
"""


class Lighthouse:
    """torchft's lighthouse in a child process (stopped by PID on exit), with its CPU time."""

    def __init__(self, **settings: int) -> None:
        env = {**os.environ, "TOKIO_WORKER_THREADS": "1"}  # the lighthouse's own runtime: as one busy core serves it
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE.format(**settings)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        address = self.process.stdout.readline().decode().strip()  # type: ignore[union-attr]
        # torchft prints its hostname; reach it on the loopback address it is bound to.
        self.address = "http://127.0.0.1:" + address.rsplit(":", 1)[1]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def ask_all(clients: list[LighthouseClient], groups: list[int], step: int) -> tuple[float, list[Any], list[float]]:
    """Every group in ``groups`` asks for a quorum at once; returns the first request's time, the quorums and each
    answer's time."""
    answered: list[float] = [0.0] * len(groups)

    def ask(index: int) -> Any:
        group = groups[index]
        quorum = clients[group % len(clients)].quorum(
            replica_id=f"group{group}",
            timeout=timedelta(seconds=120),
            address=f"http://group{group}:1",
            store_address=f"group{group}:2",
            step=step,
            world_size=1,
            shrink_only=False,
        )
        answered[index] = time.time()
        return quorum

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        started = time.time()
        quorums = list(pool.map(ask, range(len(groups))))
    return started, quorums, answered


def created(quorum: Any) -> float:
    return quorum.created.seconds + quorum.created.nanos / 1e9


def formation(clients: list[LighthouseClient], n: int) -> dict[str, float]:
    started, quorums, answered = ask_all(clients, list(range(n)), step=0)
    assert len({q.quorum_id for q in quorums}) == 1 and all(len(q.participants) == n for q in quorums)
    return {
        "formation_s": round(max(answered) - started, 4),
        "fan_out_s": round(max(answered) - created(quorums[0]), 4),
    }


def heartbeat(clients: list[LighthouseClient], groups: list[int], stop: threading.Event, interval: float) -> int:
    """Heartbeat every group of ``groups`` once per ``interval`` until ``stop``; returns the heartbeats sent."""
    sent = 0
    while not stop.is_set():
        began = time.monotonic()
        for group in groups:
            clients[group % len(clients)].heartbeat(f"group{group}")
            sent += 1
        stop.wait(max(0.0, interval - (time.monotonic() - began)))
    return sent


def heartbeats(lighthouse: Lighthouse, clients: list[LighthouseClient], n: int, seconds: float) -> dict[str, float]:
    stop = threading.Event()
    drivers = min(n, 32)
    shares = [list(range(n))[i::drivers] for i in range(drivers)]
    cpu_before = lighthouse.cpu_seconds()
    with ThreadPoolExecutor(max_workers=drivers) as pool:
        began = time.monotonic()
        futures = [pool.submit(heartbeat, clients, share, stop, 0.1) for share in shares]
        time.sleep(seconds)
        stop.set()
        sent = sum(f.result() for f in futures)
        elapsed = time.monotonic() - began
    cpu = lighthouse.cpu_seconds() - cpu_before
    return {
        "heartbeats_per_s": round(sent / elapsed, 1),
        "wanted_per_s": n * 10,
        "lighthouse_cpu_share": round(cpu / elapsed, 4),
        "lighthouse_cpu_us_per_heartbeat": round(1e6 * cpu / max(sent, 1), 2),
    }


def drop(clients: list[LighthouseClient], n: int, dead: int) -> dict[str, float]:
    """Every group heartbeats (every 250 ms, well inside the 1-s timeout); ``dead`` of them stop; the others ask for
    the next quorum at once. The time from the stop until they have it, without the dead."""
    live, gone = list(range(dead, n)), list(range(dead))
    stop_live, stop_dead = threading.Event(), threading.Event()
    drivers = min(n, 16)
    with ThreadPoolExecutor(max_workers=2 * drivers) as pool:
        for share in (live[i::drivers] for i in range(drivers)):
            pool.submit(heartbeat, clients, share, stop_live, 0.25)
        for share in (gone[i::drivers] for i in range(drivers) if gone[i::drivers]):
            pool.submit(heartbeat, clients, share, stop_dead, 0.25)
        time.sleep(1.0)
        stop_dead.set()
        stopped = time.time()
        _, quorums, answered = ask_all(clients, live, step=1)
        stop_live.set()
    assert all(len(q.participants) == len(live) for q in quorums), [len(q.participants) for q in quorums[:3]]
    return {"dead": dead, "drop_s": round(max(answered) - stopped, 4)}


def measure(n: int, heartbeat_seconds: float) -> dict[str, Any]:
    """One lighthouse per phase, with ``lightning-ft launch``'s settings (heartbeat 1 s, join 300 ms, tick 100 ms)
    and ``min_replicas`` set so that a quorum can only form with every group meant to be in it (requests from this
    one driver arrive over tens of milliseconds, and a smaller quorum would form first)."""
    record: dict[str, Any] = {"groups": n}
    dead = max(1, n // 4)
    for min_replicas, phases in ((n, ("formation", "heartbeats")), (n - dead, ("drop",))):
        lighthouse = Lighthouse(
            min_replicas=min_replicas, join_timeout_ms=300, quorum_tick_ms=100, heartbeat_timeout_ms=1000
        )
        try:
            address = lighthouse.address
            clients = [LighthouseClient(address, connect_timeout=timedelta(seconds=30)) for _ in range(CLIENTS)]
            if "formation" in phases:
                record.update(formation(clients, n))
            if "heartbeats" in phases:
                record.update(heartbeats(lighthouse, clients, n, heartbeat_seconds))
            if "drop" in phases:
                record.update(drop(clients, n, dead))
        finally:
            lighthouse.stop()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[10, 30, 100, 300, 1000])
    parser.add_argument("--heartbeat-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, help="a new file (default: results/lighthouse_scale/<UTC>_<commit>.json)")
    parser.add_argument("--label", help="appended to the default file name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    args.out = new_results_file("lighthouse_scale", args.out, args.label)  # every run is kept
    records = []
    for n in args.groups:
        record = measure(n, args.heartbeat_seconds)
        print(json.dumps(record), flush=True)
        records.append(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header(), "runs": records}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

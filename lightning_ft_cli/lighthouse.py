"""``lightning-ft lighthouse``: run torchft's lighthouse in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from lightning_ft_job.lighthouse_server import LighthouseBindError, start_lighthouse

# torchft's own defaults, sized for a cluster: a dead group is declared dead after 5 s without a heartbeat.
CLUSTER_JOIN_TIMEOUT_MS = 60000
CLUSTER_HEARTBEAT_TIMEOUT_MS = 5000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="[::]:29510", help="host:port to listen on (default: %(default)s)")
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="fewest replica groups that may form a quorum (default: 1)"
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=CLUSTER_JOIN_TIMEOUT_MS,
        help="after membership changes, how long to wait for heartbeating groups to join (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=CLUSTER_HEARTBEAT_TIMEOUT_MS,
        help="declare a group dead after this long without a heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--quorum-tick-ms",
        type=int,
        default=None,
        help="how often to re-check for a quorum while waiting for stragglers (default: torchft's, 100)",
    )


def run(args: argparse.Namespace) -> int:
    # Handlers first: whoever reads the address below may signal us at once.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        lighthouse = start_lighthouse(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
        )
    except LighthouseBindError as error:
        print(str(error), file=sys.stderr)
        return 2
    print(f"lightning-ft lighthouse: listening on {lighthouse.address}", flush=True)
    print(f"lightning-ft lighthouse: status page {lighthouse.address}/ (open in a browser)", flush=True)
    # Wake up now and then: a signal delivered to one of the lighthouse's native threads only sets CPython's flag, and
    # the handler runs when the main thread next executes Python, which an untimed wait would never let it do.
    while not stop.wait(timeout=0.5):
        pass
    lighthouse.shutdown()
    print("lightning-ft lighthouse: stopped", flush=True)
    return 0

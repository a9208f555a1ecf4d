"""``lightning-ft launch``: a lighthouse plus N replica groups on this machine, each a torchrun job with restarts.

This is deliberately thin. Restarting a failed group is torchrun's elastic agent's job (``--max-restarts``); healing
it is torchft's. The launcher only starts the pieces with the right environment, labels their output, and stops
everything it started when asked to. Across machines, use torchrun (or a scheduler) per group directly; see
``docs/operations.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO

from lightning_ft_cli.chaos import ChaosMonkey, ChaosSchedule
from lightning_ft_cli.group_environment import group_environment
from lightning_ft_cli.job_state import ArrivalWatch, JobState
from lightning_ft_cli.processes import STOP_GRACE_SECONDS, stop_process_sessions, terminate_with_parent
from lightning_ft_job import arrival, run_end
from lightning_ft_job.environment import ENV_START_TIMEOUT
from lightning_ft_job.events import ENV_EVENTS_DIR, ENV_RUN_ID, new_run_id
from lightning_ft_job.lighthouse_server import (
    LOCAL_HEARTBEAT_TIMEOUT_MS,
    LOCAL_JOIN_TIMEOUT_MS,
    LighthouseBindError,
    start_lighthouse,
)
from lightning_ft_job.torchrun import torchrun_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-groups", type=int, required=True, help="number of replica groups (N)")
    parser.add_argument(
        "--group-ids",
        type=parse_group_ids,
        default=None,
        metavar="G1,G2,...",
        help="start only these of the N groups (default: all); the others run elsewhere and join the same --lighthouse",
    )
    parser.add_argument("--nproc-per-group", type=int, default=1, help="processes per group (K, default: 1)")
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="torchrun restarts per group before giving up (default: 3)"
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="fewest groups that may form a quorum (embedded lighthouse)"
    )
    parser.add_argument("--lighthouse", default=None, help="URL of an existing lighthouse; default: start one here")
    parser.add_argument(
        "--lighthouse-bind", default="127.0.0.1:0", help="bind address of the embedded lighthouse (default: loopback)"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=LOCAL_HEARTBEAT_TIMEOUT_MS,
        help="embedded lighthouse: declare a group dead after this long without a heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=LOCAL_JOIN_TIMEOUT_MS,
        help="embedded lighthouse: wait this long for heartbeating groups to join a new quorum (default: %(default)s; "
        "LocalSGD/DiLoCo with 3 or more groups: longer than the time between two syncs, see docs/semi-sync.md)",
    )
    parser.add_argument(
        "--events-dir",
        default=None,
        help=f"write every group's JSONL event log here (sets {ENV_EVENTS_DIR}; default: each group's "
        f"<default_root_dir>/ft_events/<run id>)",
    )
    parser.add_argument(
        "--finish-grace",
        type=float,
        default=30.0,
        help="once a group has finished successfully, stop the others after this many seconds: a backstop, as a "
        "group restarted after the end exits by itself when the job keeps checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--warn-unreached-after",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="warn once about each group that has not reached the lighthouse this long into the job, or that exits 0 "
        "without reaching it: most likely its Trainer has no FTStrategy (default: %(default)s)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"how long the job's first step waits for every group to start before the job starts with the groups "
        f"present; 0 starts at once (sets {ENV_START_TIMEOUT}; default: FTStrategy's, 300)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print torchft's per-quorum INFO lines (the embedded lighthouse's and the groups' Rust side), "
        "torch's C++ warnings and Lightning's pytree FutureWarning; by default they are off (RUST_LOG=warn, "
        "TORCH_CPP_LOG_LEVEL=ERROR), and a RUST_LOG or TORCH_CPP_LOG_LEVEL you set wins either way",
    )
    chaos = parser.add_argument_group("failure rehearsal (SIGKILL a random replica group, never all at once)")
    chaos.add_argument("--chaos-every", type=float, default=None, metavar="SECONDS", help="kill every SECONDS")
    chaos.add_argument(
        "--chaos-at-steps",
        type=lambda text: tuple(int(step) for step in text.split(",")),
        default=(),
        metavar="S1,S2,...",
        help="kill when the job has committed each of these steps",
    )
    chaos.add_argument("--chaos-count", type=int, default=None, help="how many kills (default: 1, or one per step)")
    chaos.add_argument("--chaos-seed", type=int, default=None, help="seed of the choice of group")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command, e.g. -- python train.py")


@dataclass
class ReplicaGroup:
    """One replica group: the torchrun job we started, in its own session so we can stop it as a whole."""

    group_id: int
    process: subprocess.Popen[bytes]


def parse_group_ids(text: str) -> tuple[int, ...]:
    """``"2,3"`` -> ``(2, 3)``. Range and duplicates are checked in :func:`run`, which knows ``--replica-groups``."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of group ids") from None


def torchrun_command(nproc_per_group: int, max_restarts: int, cmd: list[str]) -> list[str]:
    """A standalone torchrun job that runs ``cmd`` as a whole command (``--no-python``) in each worker."""
    if cmd[0] in ("python", "python3"):
        # The workers should use the interpreter (and so the environment) that runs the launcher.
        cmd = [sys.executable, *cmd[1:]]
    elif cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    return [sys.executable, *torchrun_arguments(nproc_per_group, max_restarts), "--no-python", *cmd]


def status_page_line(lighthouse: str) -> str:
    """Where to watch the job: the lighthouse serves an HTML status page (the quorum, each group's heartbeat) at its
    own address. Printed on a line of its own, near the top of the launcher's output, so it is easy to find."""
    return f"lighthouse status page: {lighthouse.rstrip('/')}/ (open in a browser: quorum, participants, heartbeats)"


# The last line of a traceback that lightning-ft raised: ``lightning_ft.<module>.<Name>: <why>``, or a built-in error
# whose message starts with ``lightning-ft:`` (torchrun puts ``[rank<N>]: `` before each line of a worker's errors).
LIGHTNING_FT_ERROR = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?:lightning_ft(?:_\w+)?(?:\.\w+)*\.(\w+): (.+)|(?:[\w.]+\.)?(\w+): (lightning-ft: .*))$"
)


def _relay_output(group_id: int, stream: IO[bytes], lock: threading.Lock, errors: dict[int, list[str]]) -> None:
    """Print a group's output with its prefix, and keep the first and the last lightning-ft error it printed
    (``errors``): the launcher repeats them when the group fails, so that the reason is not lost above other groups'
    output. The first, because a restart's own error (no live peer left to heal from) may follow the cause."""
    prefix = f"[group {group_id}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        error = LIGHTNING_FT_ERROR.match(line)
        with lock:
            if error is not None:
                name, why = (error.group(1), error.group(2)) if error.group(1) else (error.group(3), error.group(4))
                said = errors.setdefault(group_id, [])
                said[1 if said else 0 :] = [f"{name}: {why}"]  # [first] or [first, last]
            sys.stdout.write(prefix + line + "\n")
            sys.stdout.flush()
    stream.close()


QUIET_WARNINGS = "ignore::FutureWarning:lightning.pytorch.utilities._pytree"


def _say(message: str) -> None:
    print(message, flush=True)


def chaos_schedule(args: argparse.Namespace) -> ChaosSchedule | None:
    if args.chaos_every is None and not args.chaos_at_steps:
        if args.chaos_count is not None:
            raise ValueError("--chaos-count needs --chaos-every or --chaos-at-steps")
        return None
    count = args.chaos_count if args.chaos_count is not None else max(1, len(args.chaos_at_steps))
    if args.chaos_at_steps and count > len(args.chaos_at_steps):
        raise ValueError(f"--chaos-count={count} exceeds the {len(args.chaos_at_steps)} steps of --chaos-at-steps")
    started_groups = len(args.group_ids) if args.group_ids is not None else args.replica_groups
    if started_groups < 2:
        raise ValueError(
            "--chaos-* needs at least 2 groups started here: it never kills the last group that is up, and it "
            "only kills groups this launcher started"
        )
    return ChaosSchedule(
        count=count, every_seconds=args.chaos_every, at_steps=args.chaos_at_steps, seed=args.chaos_seed
    )


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("lightning-ft launch: give the training command after --, e.g. -- python train.py", file=sys.stderr)
        return 2
    if args.replica_groups < 1 or args.nproc_per_group < 1 or args.max_restarts < 0:
        print(
            "lightning-ft launch: --replica-groups and --nproc-per-group must be >= 1, --max-restarts >= 0",
            file=sys.stderr,
        )
        return 2
    if args.start_timeout is not None and not args.start_timeout >= 0:
        print(f"lightning-ft launch: --start-timeout={args.start_timeout:g}: give 0 or more seconds.", file=sys.stderr)
        return 2
    if args.min_replicas > args.replica_groups:
        print(
            f"lightning-ft launch: --min-replicas={args.min_replicas} exceeds --replica-groups={args.replica_groups}; "
            f"no quorum could ever form.",
            file=sys.stderr,
        )
        return 2

    group_ids = args.group_ids if args.group_ids is not None else tuple(range(args.replica_groups))
    if len(set(group_ids)) != len(group_ids) or not all(0 <= g < args.replica_groups for g in group_ids):
        print(
            f"lightning-ft launch: --group-ids={','.join(map(str, group_ids))}: give distinct ids in "
            f"[0, --replica-groups={args.replica_groups}).",
            file=sys.stderr,
        )
        return 2

    try:
        schedule = chaos_schedule(args)
    except ValueError as error:
        print(f"lightning-ft launch: {error}", file=sys.stderr)
        return 2
    events_dir = args.events_dir
    scratch_events = None
    if schedule is not None and events_dir is None:  # the chaos monkey reads the event log
        events_dir = scratch_events = tempfile.mkdtemp(prefix="lightning-ft-events-")

    # torchft's Rust side (the embedded lighthouse here, each group's Manager server) logs several INFO lines per
    # quorum: one job of 100 steps printed hundreds. Read when the native module loads, so set before the lighthouse
    # starts; the groups inherit it (group_environment).
    os.environ.setdefault("RUST_LOG", "info" if args.verbose else "warn")
    if not args.verbose:  # what every worker prints once and no user acts on; a setting of the user's wins
        # torch's C++ warnings (DDP's note that find_unused_parameters=True found none unused, store retries)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # Lightning 2.6 on torch 2.13: "`isinstance(treespec, LeafSpec)` is deprecated" (later entries win)
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [QUIET_WARNINGS, os.environ.get("PYTHONWARNINGS")]))
    lighthouse = None
    url = args.lighthouse
    if url is None:
        try:
            lighthouse = start_lighthouse(
                bind=args.lighthouse_bind,
                min_replicas=args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            )
        except LighthouseBindError as error:
            if scratch_events is not None:
                shutil.rmtree(scratch_events, ignore_errors=True)
            print(str(error), file=sys.stderr)
            return 2
        url = lighthouse.address
    started = "" if args.group_ids is None else f", starting group(s) {','.join(map(str, group_ids))} here"
    run_id = os.environ.get(ENV_RUN_ID) or new_run_id()
    print(
        f"lightning-ft launch: lighthouse {url}, {args.replica_groups} replica group(s){started}, run {run_id}",
        flush=True,
    )
    print(f"lightning-ft launch: {status_page_line(url)}", flush=True)
    if args.events_dir is not None:
        print(
            f"lightning-ft launch: event log in {os.path.abspath(args.events_dir)}; draw it with "
            f"`lightning-ft report {args.events_dir} -o timeline.png`",
            flush=True,
        )

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    lock = threading.Lock()
    errors: dict[int, list[str]] = {}  # each group's first and last lightning-ft error
    monkey: ChaosMonkey | None = None
    job = JobState(group_ids, args.finish_grace, time.monotonic)
    arrivals = ArrivalWatch(group_ids, args.warn_unreached_after, time.monotonic)
    # Where the groups report the run's end (lightning_ft_job.run_end): a folder of this launch's unless set.
    configured_run_end_dir = run_end.configured_directory()
    own_run_end_dir = None if configured_run_end_dir else tempfile.mkdtemp(prefix="lightning-ft-run-end-")
    run_end_dir = configured_run_end_dir or own_run_end_dir
    groups: list[ReplicaGroup] = []
    relays: list[threading.Thread] = []
    try:
        for group_id in group_ids:
            process = subprocess.Popen(
                torchrun_command(args.nproc_per_group, args.max_restarts, cmd),
                env=group_environment(
                    group_id, args.replica_groups, url, events_dir, args.start_timeout, run_id, run_end_dir
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=terminate_with_parent(),  # the launcher SIGKILLed: its groups stop, not run on unseen
            )
            groups.append(ReplicaGroup(group_id, process))
            relay = threading.Thread(target=_relay_output, args=(group_id, process.stdout, lock, errors), daemon=True)
            relay.start()
            relays.append(relay)

        if schedule is not None:
            assert events_dir is not None
            monkey = ChaosMonkey(schedule, events_dir, {g.group_id: g.process.pid for g in groups}, _say)
            monkey.start()
        while not stop.is_set():
            # Every group, every poll: the job's state never depends on which group's process exits first.
            exit_codes = {group.group_id: group.process.poll() for group in groups}
            for line in arrivals.observe(exit_codes, arrival.arrived_groups(run_end_dir, run_id, group_ids)):
                _say(f"lightning-ft launch: {line}")
            for line in job.observe(exit_codes, set(run_end.finished_groups(run_end_dir, run_id))):
                _say(f"lightning-ft launch: {line}")
            if job.done():
                break
            stop.wait(0.2)
        if job.running and not stop.is_set():  # the grace has expired: these are stopped on purpose
            _say(
                f"lightning-ft launch: the job finished {args.finish_grace:g}s ago; stopping groups "
                f"{job.running}, which are still running (a group restarted after its peers finished would train "
                f"alone)"
            )
    finally:
        if monkey is not None:
            monkey.stop()
        stop_process_sessions([group.process for group in groups], STOP_GRACE_SECONDS)
        for relay in relays:
            relay.join(timeout=5)
        if lighthouse is not None:
            lighthouse.shutdown()
        if own_run_end_dir is not None:
            shutil.rmtree(own_run_end_dir, ignore_errors=True)
        if scratch_events is not None:
            shutil.rmtree(scratch_events, ignore_errors=True)
            print(
                "lightning-ft launch: the chaos rehearsal's event log was temporary and is deleted; pass --events-dir "
                "DIR to keep it and draw it with `lightning-ft report DIR`",
                flush=True,
            )

    if stop.is_set():
        print("lightning-ft launch: stopped on request; every group was shut down", flush=True)
        return 130
    failed = [group for group in groups if group.group_id in job.failed]
    for group in failed:
        summary = failure_summary(
            group.group_id, group.process.returncode, args.max_restarts, errors.get(group.group_id)
        )
        print(summary, file=sys.stderr, flush=True)
    return 1 if failed else 0


def failure_summary(group_id: int, exit_code: int | None, max_restarts: int, said: list[str] | None) -> str:
    """The line that closes a failed group's story: its exit, and its first and last lightning-ft errors
    (``said``, as :func:`_relay_output` keeps them), the first only where it differs."""
    said = said or []
    first = f". Its first error: {said[0].rstrip('.')}" if len(said) == 2 and said[0] != said[1] else ""
    return (
        f"lightning-ft launch: replica group {group_id} failed (exit code {exit_code}) after using up "
        f"--max-restarts={max_restarts}; its output is above, prefixed [group {group_id}]"
        + (f"{first}. Its last error: {said[-1]}" if said else ".")
    )

"""Real-process test harness: run ``lightning-ft launch`` with the test worker, watch its event log, kill by PID.

Every wait has a deadline and says what it was waiting for. Cleanup stops only what the test started: the launcher
(by PID, then its own session), which in turn stops the torchrun jobs it started.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

# Re-exported: the process tests import these from the harness too.
from helpers import REPO as REPO
from helpers import assert_tree_equal as assert_tree_equal
from helpers import describe_process as describe_process
from helpers import listening_sockets as listening_sockets
from helpers import process_gone as process_gone

from lightning_ft.manager.lighthouse_status import StatusPageUnreadable, read_status_page
from lightning_ft_job.environment import ENV_STACKS_DIR
from lightning_ft_job.events import EventLogReader

WORKERS = Path(__file__).resolve().parent / "workers"  # the programs real-process tests run
WORKER = WORKERS / "train_worker.py"
# torchft 0.2.0's status page: "Next quorum status: ... [H/N participants healthy]", N the groups whose quorum request
# the lighthouse holds for the next quorum.
_PENDING_REQUESTS = re.compile(r"\[\d+/(\d+) participants healthy\]")
T = TypeVar("T")


@dataclass
class LaunchedJob:
    process: subprocess.Popen[bytes]
    root: Path
    log_file: Any = field(repr=False)
    log_name: str = "launch.log"  # several launchers may share one root (and event log), each with its own log
    _events: EventLogReader | None = field(default=None, repr=False)

    @property
    def events_dir(self) -> Path:
        return self.root / "events"

    @property
    def out_dir(self) -> Path:
        return self.root / "out"

    @property
    def log_path(self) -> Path:
        return self.root / self.log_name

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        if not self.events_dir.exists():
            return []
        if self._events is None:  # parses only what was appended since the last call: polled many times a second
            self._events = EventLogReader(self.events_dir)
        return [
            record
            for record in self._events.records()
            if (event is None or record["event"] == event) and all(record.get(k) == v for k, v in match.items())
        ]

    def wait_for(self, what: str, condition: Callable[[], T | None], timeout: float = 120.0) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.process.poll() is not None:
                raise AssertionError(
                    f"launcher exited ({self.process.returncode}) while waiting for {what}\n{self.tail()}"
                )
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.tail()}")

    def started(self, group: int, rank: int, attempt: int | None = None) -> dict[str, Any] | None:
        """The ``started`` event of a worker's attempt (its latest one by default), or None.

        Tests follow the latest attempt because torchrun may restart a group before the test touches it: its agent
        picks the workers' MASTER_PORT by binding and closing a free port, which another process can take first.
        """
        records = self.events("started", group=group, rank=rank)
        if attempt is not None:
            records = [record for record in records if record["attempt"] == attempt]
        return max(records, key=lambda record: record["attempt"]) if records else None

    def worker_pid(self, group: int, rank: int, attempt: int | None = None) -> int:
        record = self.started(group, rank, attempt)
        return record["pid"] if record else 0

    def attempt(self, group: int, rank: int) -> int:
        record = self.started(group, rank)
        assert record is not None, f"group {group} rank {rank} has not started"
        return record["attempt"]

    def committed_steps(self, group: int, rank: int = 0, pid: int | None = None) -> list[int]:
        steps = self.events("step", group=group, rank=rank, committed=True)
        return [record["step"] for record in steps if pid is None or record["pid"] == pid]

    def hold_from_step(self, group: int, step: int, cycle: tuple[int, int] | None = None) -> Path:
        """Make ``group`` stop after the batch that takes it to ``global_step`` >= ``step`` (with ``cycle=(P, R)``,
        the first such step that is R modulo P; see the worker's ``TestGates``) until the returned file is removed.
        Written atomically: a worker never reads half of it."""
        gate = self.root / f"pause.group{group}.from_step"
        partial = gate.with_suffix(".partial")
        partial.write_text(" ".join(map(str, (step, *(cycle or ())))))
        partial.replace(gate)
        return gate

    def release_until_healed(
        self,
        holds: dict[int, Path],
        victims: int | tuple[int, ...],
        since: float,
        timeout: float = 240.0,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Let the groups held by ``holds`` (:meth:`hold_from_step`) go on one step at a time, each time every
        victim's current process has asked to join and is alive, until every victim has healed after ``since`` (or,
        with ``until``, until that holds: a heal stopped half-way by a gate); then remove the holds.

        What the survivors wait for is the victims' heal, not a step count: a restart that fails its first quorum (a
        starved heartbeat can let it form one alone, and its floor check stops it) is restarted and asks again while
        the survivors are still held, so they never run to ``max_steps`` without it. Each release lets a held group
        commit one more step: a request that reached the lighthouse after that group's makes the next step's quorum
        include it."""
        waiting = {victims} if isinstance(victims, int) else set(victims)

        def healed() -> bool:
            if until is not None and until():
                return True
            waiting.difference_update(
                {e["group"] for e in self.events("healed", rank=0) if e["time"] > since and e["step"] > 0}
            )
            if not waiting:
                return True
            pids = [self.worker_pid(victim, 0) for victim in waiting]
            # Only for a live request: a restart that asked and died meanwhile must not let the survivors go on.
            if all(pid and self.events("joining", pid=pid) and not process_gone(pid) for pid in pids):
                for group, hold in holds.items():
                    # Stopped at this hold: its current process's latest stop is at or past the hold's step (a
                    # hold only moves forward, so an earlier stop is below it). Then one step more.
                    paused = self.events("paused", pid=self.worker_pid(group, 0), phase="from_step")
                    if paused and paused[-1]["step"] >= int(hold.read_text().split()[0]):
                        partial = hold.with_suffix(".partial")
                        partial.write_text(str(paused[-1]["step"] + 1))
                        partial.replace(hold)
            return False

        self.wait_for(f"group(s) {sorted(waiting)} to heal from a live peer", healed, timeout)
        for hold in holds.values():
            hold.unlink(missing_ok=True)

    def lighthouse_url(self) -> str:
        """The embedded lighthouse's address, from the launcher's status-page line."""

        def printed() -> re.Match[str] | None:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            return re.search(r"status page: (http://\S+?)/ ", text)

        return self.wait_for("the launcher to print its lighthouse", printed).group(1)

    def wait_quorum_requests(self, what: str, count: int = 1) -> None:
        """Wait until the lighthouse holds ``count`` groups' requests for its next quorum.

        A group's ``joining`` event comes just before its request leaves: a test that releases another group on that
        event alone races the request to the lighthouse (a group that was the previous quorum's only member forms the
        next quorum at once with whoever has asked by then)."""
        url = self.lighthouse_url()
        self.wait_for(what, lambda: pending_quorum_requests(url) >= count)

    def wait_held_together(self, holds: dict[int, Path], since: float, timeout: float = 120.0) -> int:
        """Wait until every group of ``holds`` (:meth:`hold_from_step`) has committed after ``since`` and stopped at
        its hold, all of them at one step; return that step.

        Groups held apart may not meet there on their own: held from different steps (a hold computed from a step
        count read once per group, while the job commits on), or one of them a step ahead (a starved heartbeat, the
        local lighthouse's timeout being 1 s, lets it form a quorum alone), the first to stop leaves the other
        waiting at the lighthouse for a peer that is held, until its quorum timeout ends it. So while the lighthouse
        holds a request from a group that has not stopped, each stopped group goes on one step (and while all have
        stopped, at different steps, the lowest does): their next quorum includes the waiting group, which heals
        from the most advanced if it is behind, and they stop together after it."""
        url = self.lighthouse_url()
        released: dict[int, int] = {}  # group -> the step it was let go on from

        def stopped_at(group: int) -> int | None:
            paused = self.events("paused", pid=self.worker_pid(group, 0), phase="from_step")
            paused = [e for e in paused if e["time"] > since and e["step"] > released.get(group, -1)]
            return paused[-1]["step"] if paused else None

        def release(group: int, step: int) -> None:
            released[group] = step
            partial = holds[group].with_suffix(".partial")
            partial.write_text(str(step + 1))
            partial.replace(holds[group])

        def together() -> tuple[int] | None:
            stopped = {group: step for group in holds if (step := stopped_at(group)) is not None}
            if len(stopped) == len(holds) and len(set(stopped.values())) == 1:
                committed = (self.events("step", group=group, committed=True) for group in holds)
                if all(any(e["time"] > since for e in records) for records in committed):
                    return (next(iter(stopped.values())),)
            elif len(stopped) == len(holds):
                lowest = min(stopped.values())
                for group in [group for group, step in stopped.items() if step == lowest]:
                    release(group, lowest)
            elif stopped and pending_quorum_requests(url) >= 1:
                for group, step in stopped.items():
                    release(group, step)
            return None

        return self.wait_for(f"groups {sorted(holds)} to stop together at their holds", together, timeout)[0]

    def wait_held_alone(
        self, group: int, since: float, commits: int = 1, participants: int = 1, timeout: float = 120.0
    ) -> None:
        """Wait until ``group`` has committed ``commits`` steps (or syncs) with ``participants`` groups (on its own,
        by default) after ``since``, and then stopped at its ``from_step`` hold (:meth:`hold_from_step`)."""
        self.wait_for(
            f"group {group} to commit {commits} with {participants} participant(s) and stop",
            lambda: (
                any(e["time"] > since for e in self.events("paused", group=group, phase="from_step"))
                and sum(
                    e["time"] > since and e["participants"] == participants
                    for e in self.events("step", group=group, committed=True)
                )
                >= commits
            ),
            timeout,
        )

    def assert_gone_within(self, pids: list[int], since: float, bound_s: float, after: str) -> None:
        """Wait until every process of ``pids`` has exited, failing ``bound_s`` seconds after ``since`` (monotonic)
        with what each one left is doing. Whatever the outcome, none of them outlives the call (SIGKILL by PID)."""
        try:
            while not all(process_gone(pid) for pid in pids):
                left = [pid for pid in pids if not process_gone(pid)]
                assert time.monotonic() - since < bound_s, (
                    f"still running {bound_s}s after {after}:\n"
                    + "\n".join(describe_process(pid) for pid in left)
                    + "\n"
                    + self.agent_stacks(left)
                    + f"\nprocesses that said why they stop: {self.events('sigterm')}\n{self.tail()}"
                )
                time.sleep(0.1)
        finally:
            for pid in pids:
                if not process_gone(pid):
                    os.kill(pid, signal.SIGKILL)

    def agent_stacks(self, pids: list[int]) -> str:
        """Every thread's Python stack of those of ``pids`` that are torchrun agents of this job (SIGUSR1, see
        :mod:`lightning_ft_job.torchrun_agent`), for a failure message; waits up to 5 s for each dump."""
        said = []
        for pid in pids:
            path = self.root / "stacks" / f"agent-{pid}.stacks"
            if not path.exists() or process_gone(pid):
                continue
            os.kill(pid, signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while not path.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            said.append(f"torchrun agent {pid}'s threads:\n{path.read_text()}")
        return "\n".join(said)

    def wait_exit(self, timeout: float = 240.0) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout}s\n{self.tail()}") from None

    def final_states(self) -> dict[tuple[int, int], dict[str, Any]]:
        states = {}
        for path in sorted(self.out_dir.glob("final.group*.rank*.pt")):
            group, rank = path.name.removeprefix("final.group").removesuffix(".pt").split(".rank")
            states[(int(group), int(rank))] = torch.load(path, weights_only=True)
        return states

    def tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def assert_peer_deaths_were_one_line_each(self, survivor: int) -> None:
        """A survivor's terminal output (its ``[group N]`` lines) holds no traceback for a peer's death: torchft's
        handled failures are one line each, their tracebacks in the event log (``lightning_ft.manager.torchft_logs``).
        Call after the job ended (the log is complete)."""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines()
                 if line.startswith(f"[group {survivor}]")]  # fmt: skip
        tracebacks = [line for line in lines if "Traceback (most recent call last)" in line]
        assert not tracebacks, "\n".join(lines[-80:])
        said = [line for line in lines if "(torchft handles it; the traceback: the event log)" in line]
        recorded = self.events("torchft_error", group=survivor)
        assert said and len(recorded) >= len(said), (said, recorded)
        assert all("Traceback (most recent call last)" in record["traceback"] for record in recorded), recorded

    def stop(self) -> None:
        """Stop the launcher we started: SIGTERM (it stops its groups), then SIGKILL its session as a last resort."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.log_file.close()


def pending_quorum_requests(url: str) -> int:
    """How many groups' requests the lighthouse at ``url`` holds for its next quorum (0 if its page is unreadable)."""
    try:
        match = _PENDING_REQUESTS.search(read_status_page(url))
    except StatusPageUnreadable:
        return 0
    return int(match.group(1)) if match else 0


def launch_job(
    root: Path,
    *,
    groups: int,
    worker_args: list[str],
    nproc_per_group: int = 1,
    max_restarts: int = 2,
    launcher_args: list[str] | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
    log_name: str = "launch.log",
) -> LaunchedJob:
    """Start ``lightning-ft launch`` with the test worker under ``root``.

    ``wrap`` turns the launcher's argv into the command to run (e.g. on a test host in a network namespace, which
    must keep the PID: ``ip netns exec`` does); ``env`` adds environment variables.
    """
    root.mkdir(parents=True, exist_ok=True)
    log_file = open(root / log_name, "wb")  # noqa: SIM115 - closed by LaunchedJob.stop
    command = [
        sys.executable,
        "-m",
        "lightning_ft_cli",
        "launch",
        f"--replica-groups={groups}",
        f"--nproc-per-group={nproc_per_group}",
        f"--max-restarts={max_restarts}",
        f"--events-dir={root / 'events'}",
        *(launcher_args or []),
        "--",
        "python",
        str(WORKER),
        f"--out-dir={root / 'out'}",
        *(arg.format(root=root) for arg in worker_args),
    ]
    if wrap is not None:
        command = wrap(command)
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # Each torchrun agent writes its threads' stacks there on SIGUSR1 (assert_gone_within reads them).
        env={**os.environ, ENV_STACKS_DIR: str(root / "stacks"), **(env or {})},
    )
    return LaunchedJob(process=process, root=root, log_file=log_file, log_name=log_name)


def assert_bit_identical(states: dict[tuple[int, int], dict[str, Any]], replicas: int) -> None:
    """Exactly ``replicas`` final states were written, and every replica's model, optimizer and scheduler state
    equals the first one's, bit for bit (one state file alone would prove nothing)."""
    assert len(states) == replicas, f"expected {replicas} replicas' final states, found {sorted(states)}"
    (first_key, first), *others = sorted(states.items())
    for key, state in others:
        assert_tree_equal(first, state, f"{first_key} vs {key}")


def assert_listeners_confined(job: LaunchedJob, groups: int, nproc: int) -> None:
    """A local job's workers listen on loopback only, except torch's own ``env://`` store on ``MASTER_PORT``, which
    offers no bind address (see docs/security.md)."""
    for group in range(groups):
        for rank in range(nproc):
            pid = job.worker_pid(group, rank)
            environ = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            exposed = [
                (host, port)
                for host, port in listening_sockets(pid)
                if not ipaddress.ip_address(host).is_loopback and port != int(environ["MASTER_PORT"])
            ]
            assert not exposed, f"group {group} rank {rank} (pid {pid}) listens beyond loopback on {exposed}"

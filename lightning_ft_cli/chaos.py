"""``lightning-ft launch --chaos-*``: SIGKILL a random replica group on a schedule, to rehearse failures.

The schedule is either every S seconds or at given committed steps, N times. Only a group that is *up* is a
candidate (its current workers have committed a step since the latest kill), and a group is only killed while at least
one other group is up, so the job as a whole never loses every replica at once; torchrun then restarts the killed
group and it heals from the others.

The monkey only kills processes this launcher started: worker PIDs come from the job's event log, and each is
checked to be a child of the torchrun agent the launcher started for that group before it is signalled.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_ft_cli.processes import parent_pid
from lightning_ft_job.events import EventLogReader


@dataclass(frozen=True)
class ChaosSchedule:
    """When to kill: every ``every_seconds``, or at each of ``at_steps`` (committed steps), ``count`` times."""

    count: int
    every_seconds: float | None = None
    at_steps: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.every_seconds is None) == (not self.at_steps):
            raise ValueError("--chaos: give exactly one of --chaos-every SECONDS or --chaos-at-steps S1,S2,...")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ValueError(f"--chaos-every={self.every_seconds}: must be a positive number of seconds")
        if any(step < 1 for step in self.at_steps) or list(self.at_steps) != sorted(self.at_steps):
            raise ValueError(f"--chaos-at-steps={list(self.at_steps)}: must be increasing positive steps")
        if self.count < 1:
            raise ValueError(f"--chaos-count={self.count}: must be at least 1")


@dataclass
class ChaosMonkey:
    """Runs the schedule on a thread until it is done or ``stop`` is set.

    Args:
        schedule: When to kill, and how often.
        events_dir: The job's event log (the launcher sets it for every group).
        agent_pids: ``group id -> PID of the torchrun agent`` this launcher started for it.
        report: Where to print what it did.
    """

    schedule: ChaosSchedule
    events_dir: str
    agent_pids: dict[int, int]
    report: Callable[[str], None]
    kills: list[tuple[int, float]] = field(default_factory=list)
    _killed_pids: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _log: EventLogReader | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lightning-ft-chaos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ state from the event log
    def _records(self) -> list[dict]:
        """Every event so far, parsing only what was appended since the last read (polled several times a second)."""
        if self._log is None:
            self._log = EventLogReader(self.events_dir)
        return self._log.records()

    def _workers(self) -> dict[int, dict[int, dict]]:
        """``group -> rank -> latest "started" record`` of each group's current workers."""
        latest: dict[int, dict[int, dict]] = {}
        for record in self._records():
            if record["event"] == "started" and record["group"] in self.agent_pids:
                latest.setdefault(record["group"], {})[record["rank"]] = record
        return latest

    def _up_groups(self) -> list[int]:
        """Groups whose current workers are alive and have each committed a step since the latest kill.

        "Since the latest kill", not merely "since they started": survivors can sit in a collective with the dead
        group for up to ``timeout`` before they go on without it, and a group stuck like that is not up. Counting it
        would let the next kills take every group that is really training, and a restarted group would then find no
        live peer to heal from and start again from step 0.
        """
        records = self._records()
        since = self.kills[-1][1] if self.kills else 0.0
        committed_pids = {
            r["pid"] for r in records if r["event"] == "step" and r.get("committed") and r["time"] > since
        }
        # A worker that has finished is in its last moments (teardown), not training: killing it then would make
        # torchrun restart a group whose job is over.
        finished_pids = {r["pid"] for r in records if r["event"] == "finished"}
        up = []
        for group, ranks in self._workers().items():
            if ranks and all(
                r["pid"] in committed_pids
                and r["pid"] not in finished_pids
                and r["pid"] not in self._killed_pids
                and parent_pid(r["pid"]) == self.agent_pids[group]
                for r in ranks.values()
            ):
                up.append(group)
        return sorted(up)

    def _job_finished(self) -> bool:
        """Whether a group has finished training: the job is over, and nothing is left to rehearse."""
        return any(r["event"] == "finished" for r in self._records())

    def _max_committed_step(self) -> int:
        steps = [r["step"] for r in self._records() if r["event"] == "step" and r.get("committed")]
        return max(steps, default=0)

    # ------------------------------------------------------------------ the schedule
    def _run(self) -> None:
        rng = random.Random(self.schedule.seed)
        started = time.monotonic()
        while len(self.kills) < self.schedule.count and not self._stop.is_set():
            if self._job_finished():
                self.report(
                    f"lightning-ft launch: chaos: the job finished before kill {len(self.kills) + 1} of "
                    f"{self.schedule.count}; no more kills"
                )
                return
            if not self._due(started):
                self._stop.wait(0.2)
                continue
            up = self._up_groups()
            if len(up) < 2:  # never take the last group that is up
                self._stop.wait(0.2)
                continue
            self._kill(rng.choice(up))

    def _due(self, started: float) -> bool:
        done = len(self.kills)
        if self.schedule.every_seconds is not None:
            return time.monotonic() - started >= self.schedule.every_seconds * (done + 1)
        steps = self.schedule.at_steps
        return done < len(steps) and self._max_committed_step() >= steps[done]

    def _kill(self, group: int) -> None:
        killed = []
        for record in self._workers()[group].values():
            pid = record["pid"]
            if parent_pid(pid) != self.agent_pids[group]:  # not our worker (any more): never signal it
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                self._killed_pids.add(pid)
            except ProcessLookupError:
                pass
        if killed:
            self.kills.append((group, time.time()))
            self.report(
                f"lightning-ft launch: chaos: SIGKILL replica group {group} (pids {', '.join(map(str, killed))}) "
                f"at committed step {self._max_committed_step()} ({len(self.kills)}/{self.schedule.count})"
            )

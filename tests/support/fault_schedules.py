"""Random fault schedules, reproducible from a seed: a generator, the kills carried out on a real job, and the
invariants every schedule must keep.

A schedule is drawn from ``random.Random(seed)`` alone: the number of groups (2 or 3) and of processes per group,
the path (per-step DDP with either quorum mode and heal transport, HSDP, LocalSGD, DiLoCo, streaming DiLoCo), the
job's length, and 1 to 4 SIGKILLs, each of a random group at a random committed step (the job's last steps and a
group killed again right after it rejoins included) and at a random point of its step:

* ``batch_start``: at the start of a batch, its quorum asked for;
* ``quorum``: with the lighthouse's answer in hand, before the group acts on it (heals, joins the collective);
* ``allreduce``: inside the step's (or the sync's) cross-group allreduce, the peers left waiting in theirs.

On the per-step paths, half the schedules also have one step that some groups leave part of the model out of
(``--unused-bias-at-step``: the last layer's bias with DDP, a residual branch, a ``fully_shard`` module of its own,
with HSDP), often the very step a kill lands in.

A schedule drawn ``with sections`` validates every ``VALIDATE_EVERY`` batches and kills inside a sync section instead:

* ``section``: inside a validation's cross-group collective (group rank 0's, the rank that exchanges in sections),
  the peers left waiting in theirs; they take the section again on a quorum of their own, which the victim's restart
  and the groups already back in their steps may meet.

Kills are carried out one after another, never of every group at once: a group is killed only while another group
is up (its current process has committed a step, or has finished). Survivors are never held for a victim: each batch
takes ``BATCH_SLEEP_S`` more, so that a restart (a few seconds) often rejoins before the end, and a victim killed near
the end comes back after it.

The invariants (:func:`check_invariants`): the launcher exits 0 by itself, long before its ``--finish-grace`` (the
job's end, not the backstop); every group that writes a final state holds one model at exactly ``max_steps``; a group
without a final state came back after the end and said so (``job_already_finished``); no group failed for want of a
peer (``NoLivePeerError``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from harness import LaunchedJob, assert_bit_identical, assert_tree_equal, process_gone

PATHS = {
    "ddp": [],
    "ddp-sync-pg": ["--async-quorum=0", "--transport=pg"],
    "hsdp": ["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0"],
    "local_sgd": ["--algorithm=local_sgd", "--sync-every=4", "--async-quorum=0"],
    "diloco": ["--algorithm=diloco", "--sync-every=4", "--fragments=1", "--async-quorum=0"],
    "streaming_diloco": ["--algorithm=diloco", "--sync-every=4", "--fragments=2", "--async-quorum=0"],
}
SEMI_SYNC = ("local_sgd", "diloco", "streaming_diloco")
PER_STEP = ("ddp", "ddp-sync-pg", "hsdp")
POINTS = ("batch_start", "quorum", "allreduce")
SECTION_POINT = "section"
VALIDATE_EVERY = 4  # batches: a validation (a sync section) every few steps of a 24- to 40-step job
# How long one kill may take to carry out, and the job to end after the last one, on a loaded 2-core machine.
KILL_DEADLINE_S = 150.0
# Added to every batch, so that a job of 24 to 40 steps lasts about as long as a restart (an inner step of this model
# takes a millisecond): a pace, not a deadline.
BATCH_SLEEP_S = 0.25
T = TypeVar("T")
END_DEADLINE_S = 240.0
# Longer than the time between two syncs of a semi-sync path on a loaded machine (a sync every 4 paced batches).
SEMI_SYNC_JOIN_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class Kill:
    group: int
    rank: int
    step: int  # the victim stops after the batch that takes its global_step to this, then dies at ``point``
    point: str


@dataclass(frozen=True)
class LeftOut:
    step: int  # the global step whose forward pass leaves part of the model out
    groups: tuple[int, ...]  # in these groups


@dataclass(frozen=True)
class FaultSchedule:
    seed: int
    groups: int
    nproc: int
    path: str
    max_steps: int
    kills: tuple[Kill, ...]
    sections: bool = False
    left_out: LeftOut | None = None

    @property
    def worker_args(self) -> list[str]:
        validation = [f"--val-every={VALIDATE_EVERY}"] if self.sections else []
        left_out = []
        if self.left_out is not None:
            left_out = [
                f"--unused-bias-at-step={self.left_out.step}",
                f"--unused-bias-groups={','.join(map(str, self.left_out.groups))}",
                *(["--branch"] if self.path == "hsdp" else []),
            ]
        return [
            f"--max-steps={self.max_steps}",
            f"--batch-sleep={BATCH_SLEEP_S}",
            *PATHS[self.path],
            *validation,
            *left_out,
        ]

    @property
    def launcher_args(self) -> list[str]:
        """The launcher's options: a finish grace long enough never to decide a verdict, and with semi-sync and 3
        groups the join timeout that docs/semi-sync.md asks for (longer than the time between two syncs): without it
        a survivor late for the final sync ends on its own (issue 51's "semi-sync ends as one model")."""
        semi_sync_join = (
            [f"--join-timeout-ms={SEMI_SYNC_JOIN_TIMEOUT_MS}"] if self.path in SEMI_SYNC and self.groups > 2 else []
        )
        return ["--finish-grace=600", *semi_sync_join]

    @property
    def max_restarts(self) -> int:
        # Each kill costs one restart; a restart that finds its peers gone mid-join stops once more (its floor check)
        # before it reads the run's end.
        return 2 * len(self.kills) + 2

    def describe(self) -> str:
        kills = ", ".join(f"group {k.group} rank {k.rank} at step {k.step} ({k.point})" for k in self.kills)
        validation = f", validation every {VALIDATE_EVERY} batches" if self.sections else ""
        left_out = self.left_out
        leaves = f", groups {list(left_out.groups)} leave a part out at step {left_out.step}" if left_out else ""
        return (
            f"seed {self.seed}: {self.groups} groups x {self.nproc} process(es), {self.path}, "
            f"max_steps={self.max_steps}{validation}{leaves}; kills: {kills}"
        )

    def replay_command(self) -> str:
        test = (
            "test_kills_inside_sync_sections_keep_one_job_one_model"
            if self.sections
            else "test_a_random_fault_schedule_keeps_one_job_one_model"
        )
        return (
            f"FAULT_SCHEDULE_SEEDS={self.seed} .venv/bin/python -m pytest -m '' "
            f"'tests/start/test_fault_schedules.py::{test}'"
        )


def generate(seed: int, sections: bool = False) -> FaultSchedule:
    """The schedule of ``seed``: the same on every machine and Python version (only ``random.Random`` draws).

    ``sections``: the same draws, with a validation every :data:`VALIDATE_EVERY` batches and every kill inside one
    of its collectives, on group rank 0 (the seed's other schedule is unchanged)."""
    rng = random.Random(seed)
    groups = rng.choice((2, 2, 3))
    path = rng.choice(sorted(PATHS))
    nproc = 2 if path in ("ddp", "hsdp") and rng.random() < 0.2 else 1
    max_steps = rng.choice((24, 32, 40))
    count = rng.randint(1, 4)
    steps = sorted(rng.sample(range(3, max_steps), count))
    if rng.random() < 0.4:  # the job's last steps
        steps[-1] = max(steps[-1], max_steps - 1 - rng.randrange(3))
    kills: list[Kill] = []
    for step in steps:
        previous = kills[-1] if kills else None
        if previous is not None and rng.random() < 0.3:  # the same group again, right after it rejoins
            group, step = previous.group, min(previous.step + 1, max_steps - 1)
        else:
            group = rng.randrange(groups)
        kills.append(Kill(group, rng.randrange(nproc), max(step, previous.step if previous else 0), rng.choice(POINTS)))
    if sections:
        kills = [Kill(kill.group, 0, kill.step, SECTION_POINT) for kill in kills]
    left_out = None  # drawn last, so that the draws above stay what they were before it existed
    if path in PER_STEP and rng.random() < 0.5:
        step = rng.choice(kills).step if rng.random() < 0.5 else rng.randrange(max_steps)
        left_out = LeftOut(step, tuple(sorted(rng.sample(range(groups), rng.randint(1, groups)))))
    return FaultSchedule(seed, groups, nproc, path, max_steps, tuple(kills), sections, left_out)


def _up(job: LaunchedJob, group: int, nproc: int) -> bool:
    """Whether every process of ``group`` runs and has committed a step since it started (or has finished). A group
    whose latest processes are gone is restarting: its rank 0's old ``started`` record is still the latest one."""
    pids = [job.worker_pid(group, rank) for rank in range(nproc)]
    if not all(pids) or any(map(process_gone, pids)):
        return bool(pids[0]) and bool(job.events("finished", pid=pids[0]))
    return all(job.events("step", pid=pid, committed=True) or job.events("finished", pid=pid) for pid in pids)


def came_back_after_the_end(job: LaunchedJob, group: int) -> bool:
    """Whether ``group``'s latest process found the run ended and exited (it says so before its ``started``)."""
    last_start = max((e["time"] for e in job.events("started", group=group)), default=0.0)
    return any(e["time"] > last_start for e in job.events("job_already_finished", group=group))


class _JobOver(Exception):
    """The launcher exited while a kill was being carried out."""


def _wait(job: LaunchedJob, what: str, condition: Callable[[], T | None]) -> T:
    """``job.wait_for``, except that a launcher that exited means the job is over (:class:`_JobOver`)."""
    deadline = time.monotonic() + KILL_DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        if job.process.poll() is not None:
            raise _JobOver(what)
        assert time.monotonic() < deadline, f"timed out after {KILL_DEADLINE_S}s waiting for {what}\n{job.tail()}"
        time.sleep(0.05)


def carry_out(job: LaunchedJob, schedule: FaultSchedule, said: list[str]) -> None:
    """SIGKILL each victim of ``schedule`` where it says; ``said`` collects what happened to each kill.

    Each kill waits for another group to be up and for the victim's current processes to run, then stops the victim as
    it     reach its step (a hold, so that it dies there however fast the job runs), then lets it go on to its point (a
    gate) and kills it there. The survivors are never held: whether a restart heals or comes back after the end is
    the machine's timing, and the invariants hold either way."""
    for index, kill in enumerate(schedule.kills):
        try:
            said.append(_carry_out_one(job, schedule, kill))
        except _JobOver:
            said.extend(f"{later}: the job had ended" for later in schedule.kills[index:])
            return


def _carry_out_one(job: LaunchedJob, schedule: FaultSchedule, kill: Kill) -> str:
    others = [g for g in range(schedule.groups) if g != kill.group]
    _wait(job, f"another group than {kill.group} to be up", lambda: any(_up(job, g, schedule.nproc) for g in others))

    def alive() -> list[int] | str | None:
        """The victim's current processes once every one of them runs, or "ended" once it found the run ended."""
        if came_back_after_the_end(job, kill.group):
            return "ended"
        pids = [job.worker_pid(kill.group, r) for r in range(schedule.nproc)]
        return pids if all(pids) and not any(map(process_gone, pids)) else None

    pids = _wait(job, f"group {kill.group}'s current processes to run", alive)
    if pids == "ended":
        return f"{kill}: the victim came back after the end"
    assert isinstance(pids, list)
    pid = pids[kill.rank]

    def gone() -> bool:
        return any(map(process_gone, pids))

    set_at = time.time()
    victim_hold = job.hold_from_step(kill.group, kill.step)
    gate = job.root / f"pause.group{kill.group}.{kill.point}"
    try:
        _wait(
            job,
            f"group {kill.group} (pid {pid}) to stop at step {kill.step} or end",
            lambda: gone() or [e for e in job.events("paused", pid=pid, phase="from_step") if e["time"] > set_at],
        )
        if gone():
            return f"{kill}: the victim ended before its step"
        gate.touch()
        victim_hold.unlink()
        paused = _wait(job, f"group {kill.group} (pid {pid}) to stop at its {kill.point} or end",
                       lambda: gone() or [e for e in job.events("paused", pid=pid, phase=kill.point)
                                          if e["time"] > set_at])  # fmt: skip
        if paused is True:
            return f"{kill}: the victim ended before its {kill.point}"
        assert isinstance(paused, list)
        os.kill(pid, signal.SIGKILL)
        # Dead before the next kill looks at who is up: a SIGKILL is delivered, not done, when os.kill returns.
        _wait(job, f"pid {pid} to die", lambda: process_gone(pid))
    finally:
        gate.unlink(missing_ok=True)
        victim_hold.unlink(missing_ok=True)
    return f"{kill}: killed pid {pid} at {kill.point} of step {paused[0]['step']}"


def check_invariants(job: LaunchedJob, schedule: FaultSchedule) -> None:
    """The job ended by itself with exit 0; one model at exactly ``max_steps`` in every group that reports; a group
    without a final state came back after the end and said so."""
    assert job.wait_exit(timeout=END_DEADLINE_S) == 0, job.tail(120)
    log = job.log_path.read_text(errors="replace")
    assert "stopping groups" not in log, "the launcher needed its backstop: a group did not end by itself"
    assert "NoLivePeerError" not in log, "a restarted group waited for peers that were gone"
    states = job.final_states()
    assert states, "no group reported a final state"
    for key, state in states.items():
        assert state["global_step"] == schedule.max_steps, f"{key}: global_step {state['global_step']}"
    if schedule.path in SEMI_SYNC:
        (first_key, first), *others = sorted(states.items())
        for key, state in others:
            for name in ("outer_state", "model", "lr_schedulers", "lrs"):
                assert_tree_equal(first[name], state[name], f"{first_key} vs {key} {name}")
    elif len(states) > 1:
        assert_bit_identical(states, replicas=len(states))
    reported = {group for group, _ in states}
    for group in range(schedule.groups):
        if group not in reported:
            assert job.events("job_already_finished", group=group), (
                f"group {group} wrote no final state and did not say that it came back after the end"
            )
        else:  # every rank writes one, but a sharded (HSDP) group's rank 0 alone writes its gathered state
            ranks = {rank for g, rank in states if g == group}
            writers = {0} if schedule.path == "hsdp" else set(range(schedule.nproc))
            assert ranks == writers, f"group {group}: final states of ranks {sorted(ranks)}"


def seeds_from_environment(default: list[int]) -> list[int]:
    """``FAULT_SCHEDULE_SEEDS=3,17`` replays those seeds instead of ``default``."""
    value = os.environ.get("FAULT_SCHEDULE_SEEDS", "").strip()
    return [int(seed) for seed in value.split(",")] if value else default

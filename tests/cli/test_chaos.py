"""``lightning-ft launch --chaos-*``: random replica groups SIGKILLed on a schedule, never all at once; the job still
ends with every replica at max_steps committed steps and bit-identical."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from harness import REPO, LaunchedJob, assert_bit_identical, process_gone
from matrix import write
from test_fault_tolerance import GATES, start_together

from lightning_ft_cli.chaos import ChaosMonkey, ChaosSchedule
from lightning_ft_cli.launch import add_arguments, chaos_schedule, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "--", "python", "train.py"])


def test_no_chaos_without_a_schedule():
    assert chaos_schedule(parse("--replica-groups=2")) is None


def test_a_schedule_at_steps_kills_once_per_step_by_default():
    schedule = chaos_schedule(parse("--replica-groups=3", "--chaos-at-steps=10,30", "--chaos-seed=4"))
    assert schedule == ChaosSchedule(count=2, at_steps=(10, 30), seed=4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replica-groups=2", "--chaos-count=2"], "needs --chaos-every or --chaos-at-steps"),
        (["--replica-groups=1", "--chaos-every=5"], "at least 2"),
        (["--replica-groups=2", "--chaos-at-steps=10,5"], "increasing"),
        (["--replica-groups=2", "--chaos-at-steps=10", "--chaos-count=2"], "exceeds"),
        (["--replica-groups=2", "--chaos-every=0"], "positive"),
        (["--replica-groups=2", "--chaos-every=5", "--chaos-at-steps=3"], "exactly one"),
    ],
)
def test_bad_chaos_settings_are_refused_before_anything_starts(argv, message, capsys):
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_the_command_line_refuses_them_too():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ft_cli", "launch", "--replica-groups=1", "--chaos-every=5", "--", "ls"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "at least 2" in result.stderr, result


def chaos_kills(job: LaunchedJob) -> list[tuple[int, set[int]]]:
    """Every kill the launcher reported so far: the group, and the PIDs it killed."""
    log = job.log_path.read_text(errors="replace")
    return [
        (int(group), {int(pid) for pid in pids.split(", ")})
        for group, pids in re.findall(r"chaos: SIGKILL replica group (\d+) \(pids ([\d, ]+)\)", log)
    ]


def hold_others_until_the_victim_is_back(job: LaunchedJob, kill: int, groups: int) -> None:
    """After the launcher's kill number ``kill`` (1-based), hold every other (one-process) group between two batches
    (its Manager heartbeating) until each of them has stopped there and torchrun's restart of the victim asks for its
    first quorum. Then all of them ask for the next quorum together: the victim heals from a live peer, however long
    its restart took, and no group can be left out of the rest of the job.

    Waiting for each survivor to *stop* matters: a survivor can be held up by the kill itself (in the victim's last
    allreduce, or in the rendezvous of a quorum that the victim joined just before it died) until the collective
    timeout. Released early, the others could finish the job meanwhile, and it would come back to train alone."""
    victim, killed = job.wait_for(
        f"chaos kill {kill}", lambda: len(kills := chaos_kills(job)) >= kill and kills[kill - 1]
    )
    others = [group for group in range(groups) if group != victim]
    held_since = time.time()
    for group in others:
        (job.root / f"pause.group{group}.rank0").touch()
    killed_started = max(e["time"] for e in job.events("started", group=victim) if e["pid"] in killed)
    restarted = job.wait_for(
        f"torchrun to restart group {victim}",
        lambda: [e["pid"] for e in job.events("started", group=victim) if e["time"] > killed_started],
    )
    job.wait_for(
        f"the restarted group {victim} to ask for its first quorum", lambda: job.events("joining", pid=restarted[0])
    )
    for group in others:
        job.wait_for(
            f"group {group} to stop between two batches",
            lambda group=group: [e for e in job.events("paused", group=group) if e["time"] > held_since],
        )
    for group in others:
        (job.root / f"pause.group{group}.rank0").unlink()


def assert_survived(job: LaunchedJob, *, case: str, max_steps: int, kills: int, timeout: float) -> None:
    assert job.wait_exit(timeout=timeout) == 0, job.tail()
    assert len(chaos_kills(job)) == kills, job.tail()
    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0), (2, 0)], f"{sorted(states)}\n{job.tail()}"
    for key, state in states.items():
        assert state["global_step"] == max_steps, f"{key}: global_step {state['global_step']} != {max_steps}"
        assert state["manager_step"] == max_steps, f"{key}: manager step {state['manager_step']} != {max_steps}"
    assert_bit_identical(states, replicas=3)
    # No committed step was ever lost: every restarted process healed from a live peer at a step past 0 (a restart
    # that found no live peer would start again from step 0 and still end "identical").
    for started in job.events("started"):
        if started["attempt"] > 0:
            heals = [e["step"] for e in job.events("healed", pid=started["pid"])]
            assert heals and heals[0] > 0, f"restarted group {started['group']} did not heal from a peer: {heals}"
    uncommitted = len(job.events("step", rank=0, committed=False))
    write({"case": case, "kills": kills, "uncommitted_steps_all_groups": uncommitted, "identical": True})


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_chaos_at_steps_kills_groups_and_the_job_still_finishes_identical(launch):
    """3 groups; the launcher kills a random group that is up at committed steps 30 and 80 (a victim counts as up
    again once its restarted workers have committed a step). After each kill the test holds the other groups until
    the victim's restart is back, so that the job cannot end before both victims have healed, however loaded the
    machine is."""
    max_steps = 120
    job = launch(
        groups=3,
        max_restarts=3,
        worker_args=[f"--max-steps={max_steps}", *GATES],
        launcher_args=["--chaos-at-steps=30,80", "--chaos-seed=0"],
    )
    start_together(job, groups=3, nproc=1)
    for kill in (1, 2):
        hold_others_until_the_victim_is_back(job, kill, groups=3)
    assert_survived(job, case="--chaos-at-steps 30,80, 3 groups", max_steps=max_steps, kills=2, timeout=380)


@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_twenty_random_kills_of_three_groups(launch):
    """The soak run of the fault matrix: 20 SIGKILLs of random groups in one run of 3 groups. The kills are due at
    committed steps spread over the run, not every few seconds: on a fast machine a time schedule let the job reach
    ``max_steps`` after 10 of them. After each kill the other groups are held until the victim's restart is back,
    so every one of the 20 restarts heals from a live peer, however loaded the machine is."""
    max_steps = 8000
    kills = 20
    kill_steps = [300 + 370 * k for k in range(kills)]  # 300 ... 7330
    job = launch(
        groups=3,
        max_restarts=kills + 5,
        worker_args=[f"--max-steps={max_steps}", *GATES],
        launcher_args=[f"--chaos-at-steps={','.join(map(str, kill_steps))}", "--chaos-seed=1"],
    )
    start_together(job, groups=3, nproc=1)
    for kill in range(1, kills + 1):
        hold_others_until_the_victim_is_back(job, kill, groups=3)
    assert_survived(job, case="20 random kills of 3 groups (soak)", max_steps=max_steps, kills=kills, timeout=1100)


def test_the_chaos_monkey_kills_nobody_once_the_job_has_finished(tmp_path):
    """Two "groups", each an agent process with one worker child, both having committed steps; one has logged
    ``finished`` (its worker in teardown). The monkey's step is due, yet it must kill nobody: a worker killed after the
    end made torchrun restart a group whose job was over (the DiLoCo hang, once in ten runs). At 6bcf74e it killed
    one of them."""
    sleeper = "import time; time.sleep(120)"
    agent = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {sleeper!r}]); "
        f"print(p.pid, flush=True); time.sleep(120)"
    )
    agents = [subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    workers = [int(a.stdout.readline()) for a in agents]
    said: list[str] = []
    try:
        now = time.time()
        lines = []
        for group, worker in enumerate(workers):
            base = {"group": group, "rank": 0, "pid": worker}
            lines += [{**base, "event": "started", "time": now, "attempt": 0},
                      {**base, "event": "step", "time": now + 1, "step": 5, "committed": True}]  # fmt: skip
        lines.append({"group": 0, "rank": 0, "pid": workers[0], "event": "finished", "time": now + 2, "step": 5})
        for group in (0, 1):
            text = "".join(json.dumps(line) + "\n" for line in lines if line["group"] == group)
            (tmp_path / f"group{group}.rank0.jsonl").write_text(text)
        monkey = ChaosMonkey(ChaosSchedule(count=1, at_steps=(3,), seed=0), str(tmp_path),
                             {g: a.pid for g, a in enumerate(agents)}, said.append)  # fmt: skip
        monkey.start()
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        monkey.stop()
        assert said and "the job finished before kill 1 of 1" in said[0], said
        assert not monkey.kills and not any(map(process_gone, workers)), said
    finally:
        for pid in [*workers, *(a.pid for a in agents)]:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        for a in agents:
            a.wait(timeout=10)

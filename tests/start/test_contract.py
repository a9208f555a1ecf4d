"""One job, one contract, with real processes: a group whose configuration differs from its peers' stops before its
first step, with an error that names each differing setting and both values, and the launcher repeats it; the
groups that agree train on as one model.

Two ways in, one rule (``lightning_ft.start.contract``):

* **At the job's start**, three groups vote: the odd one (each listed setting in turn, each group in turn as the odd
  one, group 0 the heal source of ``init_sync`` included) stops, and the other two commit every step together.
* **A restart whose host's configuration was edited** heals from the running job and is refused before it loads
  anything; the survivor commits every step exactly once.

Each test was checked to fail without the check (``install_contract_check`` not called): the odd group trains (to
its own ``max_steps``, at its own accumulation or precision), commits steps, and no refusal is printed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness import LaunchedJob, assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MAX_STEPS = 20


def edit_group(root: Path, group: int, arguments: str) -> None:
    """One host's edited configuration: arguments that group ``group``'s next process start adds to the job's."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"args.group{group}").write_text(arguments)


def assert_refused(job: LaunchedJob, group: int, differences: list[dict[str, str]], where: str) -> None:
    """Group ``group`` stopped on the contract, naming exactly ``differences``, before any step or heal; the launcher
    repeats the error once the group has failed."""
    refusals = job.events("contract_refused", group=group)
    assert refusals and all(r["differences"] == differences for r in refusals), (refusals, job.tail())
    assert not job.events("step", group=group, pid=refusals[-1]["pid"]), "the refused process took a step"
    assert not job.events("healed", group=group, pid=refusals[-1]["pid"]), "the refused process loaded a state"
    named = "; ".join(f"{d['setting']} is {d['here']} here and {d['there']} there" for d in differences)
    log = job.log_path.read_text(errors="replace")
    expected = f"Its last error: JobContractError: lightning-ft: replica group {group} is set up for another job than "
    summary = [line for line in log.splitlines() if line.startswith(f"lightning-ft launch: replica group {group} fail")]
    assert summary and expected in summary[-1] and where in summary[-1] and named in summary[-1], job.tail()


@pytest.mark.parametrize(
    ("odd", "edit", "differences"),
    [
        pytest.param(0, "--max-steps=24", [("max_steps", "24", "20")], id="max_steps-group0"),
        pytest.param(
            1, "--accumulate=2", [("accumulate_grad_batches", "2", "1")], id="accumulate-group1",
            marks=pytest.mark.paths,
        ),
        pytest.param(
            2, "--precision=16-mixed", [("precision", "'16-mixed'", "'32-true'")], id="precision-group2",
            marks=pytest.mark.paths,
        ),
    ],
)  # fmt: skip
def test_a_group_set_up_for_another_job_stops_at_the_start_and_the_others_train_as_one_model(
    launch, tmp_path, odd, edit, differences
):
    """Three groups; group ``odd`` was started with one setting edited. At the job's first quorum the three compare
    their settings: the odd group stops, the two that agree fail that step (and drop what ``init_sync`` may have
    sent them from the odd group), and then commit every step together."""
    edit_group(tmp_path / "job", odd, edit)
    job = launch(groups=3, max_restarts=0, worker_args=[f"--max-steps={MAX_STEPS}", "--group-args={root}", *GATES])
    start_together(job, groups=3, nproc=1)
    assert job.wait_exit() == 1, job.tail()

    others = [group for group in range(3) if group != odd]
    expected = [{"setting": name, "here": here, "there": there} for name, here, there in differences]
    assert_refused(job, odd, expected, f"than replica group(s) {others}, the majority of the job's first quorum")
    for group in others:
        votes = job.events("job_contract", group=group)
        assert votes[0]["odd"] == [odd] and votes[0]["majority"], votes
        assert votes[-1]["agreed"] and votes[-1]["groups"] == others, votes
        committed = job.events("step", group=group, committed=True)
        assert [e["step"] for e in committed] == list(range(1, MAX_STEPS + 1)), job.tail()
        assert all(e["participants"] == 2 for e in committed), committed
    states = job.final_states()
    assert sorted(states) == [(group, 0) for group in others], sorted(states)
    assert_bit_identical(states, replicas=2)
    assert all(state["global_step"] == MAX_STEPS for state in states.values())


@pytest.mark.parametrize(
    "victim", [pytest.param(1, id="group1"), pytest.param(0, id="group0", marks=pytest.mark.paths)]
)
def test_a_group_restarted_with_an_edited_configuration_is_refused_when_it_heals(launch, tmp_path, victim):
    """Two groups train; ``victim`` is SIGKILLed, and its host's configuration is edited before torchrun restarts it
    (two settings: another ``max_steps`` and another accumulation). The restart heals from the survivor, which
    carries the job's settings: it is refused before it loads anything, naming both settings and both values. The
    survivor commits every step exactly once and finishes."""
    survivor = 1 - victim
    job = launch(groups=2, max_restarts=1, worker_args=[f"--max-steps={MAX_STEPS}", "--group-args={root}", *GATES])
    start_together(job, groups=2, nproc=1)
    pid = job.worker_pid(victim, 0)
    job.wait_for(
        f"group {victim} to commit 3 steps with its peer",
        lambda: sum(e["participants"] == 2 for e in job.events("step", group=victim, pid=pid, committed=True)) >= 3,
    )
    hold = job.hold_from_step(survivor, max(job.committed_steps(victim, 0, pid)) + 6)
    edit_group(job.root, victim, f"--max-steps={MAX_STEPS + 10} --accumulate=2")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    job.wait_held_alone(survivor, since=killed_at)
    restarted = job.wait_for(f"torchrun to restart group {victim}", lambda: job.worker_pid(victim, 0, 1))
    job.wait_for(f"group {victim} to ask to join", lambda: job.events("joining", pid=restarted))
    job.wait_quorum_requests(f"the lighthouse to hold group {victim}'s request")
    hold.unlink()
    assert job.wait_exit() == 1, job.tail()

    expected = [
        {"setting": "accumulate_grad_batches", "here": "2", "there": "1"},
        {"setting": "max_steps", "here": str(MAX_STEPS + 10), "there": str(MAX_STEPS)},
    ]
    assert_refused(job, victim, expected, f"than the running job (it heals from replica group {survivor} at")
    assert [e["attempt"] for e in job.events("started", group=survivor)] == [0]
    committed = job.committed_steps(survivor)
    assert committed == list(range(1, MAX_STEPS + 1)), job.tail()
    states = job.final_states()
    assert list(states) == [(survivor, 0)], sorted(states)
    assert_bit_identical(states, replicas=1)
    assert states[(survivor, 0)]["global_step"] == MAX_STEPS


@pytest.mark.paths
def test_two_groups_that_build_different_models_both_stop_at_the_start(launch, tmp_path):
    """Two groups, group 1's model wider from the start: no majority can tell which model is the job's, so both stop
    before their first step, each naming the model's structure and both values, and the launcher says so for each.
    Nothing trains. (A restart whose model differs from a running job's is refused by the heal's own check, which
    names each parameter: ``tests/heal/test_incompatible_replicas.py``.)"""
    edit_group(tmp_path / "job", 1, "--hidden-for-group=1:48")
    job = launch(groups=2, max_restarts=0, worker_args=[f"--max-steps={MAX_STEPS}", "--group-args={root}", *GATES])
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit() == 1, job.tail()
    for group in (0, 1):
        (refusal,) = job.events("contract_refused", group=group)
        assert [d["setting"] for d in refusal["differences"]] == ["model structure"], refusal
        assert refusal["peers"] == [1 - group], refusal
    summary = [line for line in job.log_path.read_text().splitlines() if "Its last error: JobContractError" in line]
    assert len(summary) == 2 and all("no majority can tell which is right" in line for line in summary), job.tail()
    assert not job.events("step", committed=True), "a group trained"

"""A group that comes back after its run finished exits 0 by itself, on every path, and the launcher ends at once.

The victim is SIGKILLed a few steps before ``max_steps``; torchrun restarts it, but the test holds the restart before
it builds its Trainer (the worker's ``hold_start.group<G>``) until every other group has finished and exited. The
restarted group must then read the run's end (:mod:`lightning_ft_job.run_end`), say so in one line and exit 0 without
training, and the launcher must exit 0 long before its ``--finish-grace`` of 600 s (the mechanism under test, not the
backstop). No checkpoints are kept: the job has no record on disk, only its run.

At 6bcf74e the restarted group waited ``start_timeout`` (300 s) for peers that were gone and then failed with
``NoLivePeerError``; the launcher, which stopped reading exit codes at the first running group, never noticed that
the victim's peers had finished when the victim was group 0. Each case here times out there.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness import assert_bit_identical, assert_tree_equal, process_gone
from test_fault_tolerance import GATES, start_together
from test_one_job import held_at_start

from lightning_ft_job.run_end import ENV_RUN_END_DIR

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

HSDP = ["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0"]
LOCAL_SGD = ["--algorithm=local_sgd", "--sync-every=4", "--async-quorum=0"]
DILOCO = ["--algorithm=diloco", "--sync-every=4", "--fragments=1", "--async-quorum=0"]
STREAMING = ["--algorithm=diloco", "--sync-every=4", "--fragments=2", "--async-quorum=0"]


@pytest.mark.parametrize(
    ("path", "groups", "victim", "before_end"),
    [
        pytest.param([], 2, 0, 3, id="ddp-2-groups-group-0-killed"),
        pytest.param(DILOCO, 3, 1, 3, id="diloco-3-groups-group-1-killed"),
        pytest.param(HSDP, 2, 1, 2, id="hsdp-2-groups-group-1-killed", marks=pytest.mark.paths),
        pytest.param(LOCAL_SGD, 2, 0, 3, id="local_sgd-2-groups-group-0-killed", marks=pytest.mark.paths),
        pytest.param(STREAMING, 2, 0, 1, id="streaming-diloco-2-groups-group-0-killed", marks=pytest.mark.paths),
        pytest.param([], 3, 2, 1, id="ddp-3-groups-group-2-killed-1-step-before-the-end", marks=pytest.mark.paths),
    ],
)
def test_a_group_restarted_after_its_run_finished_exits_0_and_the_launcher_ends(
    launch, path, groups, victim, before_end
):
    max_steps = 24
    job = launch(groups=groups, worker_args=[f"--max-steps={max_steps}", *path, *GATES],
                 launcher_args=["--finish-grace=600"])  # fmt: skip
    root = job.root
    start_together(job, groups=groups, nproc=1)
    held = job.hold_from_step(victim, max_steps - before_end)
    job.wait_for(f"group {victim} to stop {before_end} step(s) before the end",
                 lambda: job.events("paused", group=victim, phase="from_step"))  # fmt: skip
    (root / f"hold_start.group{victim}").touch()
    killed_at = time.time()
    os.kill(job.worker_pid(victim, 0), signal.SIGKILL)
    held.unlink()
    job.wait_for(f"torchrun to restart group {victim} (held at its start)", lambda: held_at_start(root, victim, 1))
    survivors = [g for g in range(groups) if g != victim]
    pids = [job.worker_pid(g, 0) for g in survivors]
    job.wait_for(
        "every other group to finish and exit",
        lambda: all(job.events("finished", group=g) for g in survivors) and all(map(process_gone, pids)),
        timeout=240,  # a deadline for a loaded machine: the survivors' pace is not under test
    )
    released_at = time.monotonic()
    (root / f"hold_start.group{victim}").unlink()
    assert job.wait_exit(timeout=120) == 0, job.tail()
    assert time.monotonic() - released_at < 120

    log = job.log_path.read_text()
    said = [line for line in log.splitlines() if "exits without training: its run" in line]
    assert len(said) == 1 and f"[group {victim}]" in said[0], said
    assert "NoLivePeerError" not in log and "stopping groups" not in log, job.tail()
    assert job.events("job_already_finished", group=victim)
    assert not [e for e in job.events(group=victim) if e["time"] > killed_at and e["event"] in ("started", "step")]
    states = job.final_states()
    assert sorted(states) == [(g, 0) for g in survivors], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == max_steps, key
    assert_one_model(states, semi_sync="--algorithm" in " ".join(path))


def assert_one_model(states: dict, semi_sync: bool) -> None:
    """Per step, every replica's whole state is bit-identical; semi-synchronously, what the syncs make one (each group
    keeps its own inner optimizer state): the parameters, the LR schedules and DiLoCo's outer state."""
    if not semi_sync:
        assert_bit_identical(states, replicas=len(states))
        return
    (first_key, first), *others = sorted(states.items())
    for key, state in others:  # (a job of 2 groups, one of them back after the end, has one final state)
        for name in ("outer_state", "model", "lr_schedulers", "lrs"):
            assert_tree_equal(first[name], state[name], f"{first_key} vs {key} {name}")


def test_a_group_whose_process_crashes_after_it_finished_is_restarted_into_the_end_and_the_job_exits_0(launch):
    """Group 0 finishes and then its process exits 9 (a teardown that crashed after the final state); its restart
    reads the run's end and exits 0. The job's two final states are identical and the launcher exits 0."""
    max_steps = 20
    job = launch(groups=2, worker_args=[f"--max-steps={max_steps}", "--crash-after-fit=0", *GATES])
    start_together(job, groups=2, nproc=1)
    assert job.wait_exit(timeout=180) == 0, job.tail()
    assert job.events("job_already_finished", group=0), job.tail()
    assert len(job.events("finished", group=0)) == 1
    states = job.final_states()
    assert_bit_identical(states, replicas=2)
    for state in states.values():
        assert state["global_step"] == max_steps


@pytest.mark.paths  # make test: a new run in a used folder, in process (tests/strategy/test_lightning_behaviour.py)
def test_a_new_run_in_the_folder_of_a_finished_run_is_a_new_job_and_trains(launch, tmp_path):
    """Two launches of one job, one after the other, in one folder: one event log, one output folder and one folder
    of run-end reports (``LIGHTNING_FT_RUN_END_DIR``, as a job on a shared filesystem sets it). The job is the run, not
    the folder: the second launch is a new run, trains every step and writes its final states; none of its groups
    takes the first run's reports for its own end. (Checked to fail with the reports read without the run id: the
    second run's groups exit at once as "already finished".)"""
    max_steps = 10
    env = {ENV_RUN_END_DIR: str(tmp_path / "run_end")}
    first = launch(groups=2, worker_args=[f"--max-steps={max_steps}"], env=env)
    assert first.wait_exit(timeout=180) == 0, first.tail()
    reports = list((tmp_path / "run_end").glob("run_end.*"))  # beside each group's word that it arrived
    assert len(reports) == 2, "each group of the first run reports its end"
    second_started = time.time()

    second = launch(groups=2, worker_args=[f"--max-steps={max_steps}"], env=env, log_name="second.log")
    assert second.root == first.root  # one event log for both runs: the second's records are the later ones
    assert second.wait_exit(timeout=180) == 0, second.tail()
    assert not [e for e in second.events("job_already_finished") if e["time"] > second_started], second.tail()
    for group in (0, 1):
        [pid] = [e["pid"] for e in second.events("started", group=group) if e["time"] > second_started]
        assert sorted(second.committed_steps(group, pid=pid)) == list(range(1, max_steps + 1)), group
    states = second.final_states()
    assert all(path.stat().st_mtime > second_started for path in second.out_dir.glob("final.*.pt"))
    assert_bit_identical(states, replicas=2)
    for state in states.values():
        assert state["global_step"] == state["manager_step"] == max_steps


# In `make test-extra` (`make test` stays under 20 minutes): a restarted group with no peer and no checkpoints,
# which must not start the job over either, runs in `make test` (test_one_job.py).
@pytest.mark.paths
def test_every_group_down_at_once_without_checkpoints_never_starts_the_job_over(launch):
    """Group 0 is killed; while its restart asks to join (its floor: the job's last quorum), group 1, held between two
    batches, is killed too: every group is down and the job keeps no checkpoint. The restarts meet in a quorum of
    their own at step 0, which the lighthouse then takes for the job's last one; each later restart must still know
    that the job was past it (the run remembers it) and stop, never train the job over from its initial weights. At
    6bcf74e the second restarts did: the job "finished" at max_steps from step 0, its committed steps lost."""
    max_steps = 60
    job = launch(groups=2, max_restarts=2, worker_args=[f"--max-steps={max_steps}", "--start-timeout=5", *GATES])
    start_together(job, groups=2, nproc=1)
    job.wait_for(
        "both groups to commit 5 steps together",
        lambda: sum(e["participants"] == 2 for e in job.events("step", group=1, committed=True)) >= 5,
    )
    group1 = job.worker_pid(1, 0)
    held = job.hold_from_step(1, max(job.committed_steps(1)) + 2)
    job.wait_for("group 1 to stop between batches", lambda: job.events("paused", pid=group1, phase="from_step"))
    group0 = job.worker_pid(0, 0)
    os.kill(group0, signal.SIGKILL)
    restarted = job.wait_for("group 0's restart", lambda: job.worker_pid(0, 0, 1))
    job.wait_for("group 0's restart to ask to join", lambda: job.events("joining", pid=restarted))
    os.kill(group1, signal.SIGKILL)
    held.unlink()
    assert job.wait_exit(timeout=300) == 1, job.tail()
    assert not job.events("finished"), "the job was trained over from step 0"
    assert not job.final_states()
    assert job.events("behind_checkpoint")


HSDP_TWO_PROCESSES = [*HSDP]  # with nproc 2: the check's verdict is taken on rank 0 and broadcast in the group

LAST_STEP_PATHS = {  # id: path, processes per group, straggler
    "ddp-group-0": ([], 1, 0),
    "ddp-synchronous-quorum-group-2": (["--async-quorum=0"], 1, 2),
    "hsdp-2-processes-group-1": (HSDP_TWO_PROCESSES, 2, 1),
    "diloco-group-0": (DILOCO, 1, 0),  # the last vote is the final sync's, inside torchft's DiLoCo
    "local_sgd-group-2": (LOCAL_SGD, 1, 2),
    "streaming-diloco-group-1": (STREAMING, 1, 1),
}


def last_step_cases(in_make_test: str) -> list:
    """Every path of :data:`LAST_STEP_PATHS`; ``make test`` runs one of them, ``make test-extra`` the others."""
    return [
        pytest.param(*case, id=name, marks=() if name == in_make_test else pytest.mark.paths)
        for name, case in LAST_STEP_PATHS.items()
    ]


def state_ranks(path: list[str], nproc: int) -> range:
    """The ranks of a group that write a final state: every DDP replica; with FSDP, rank 0 (the group's full state)."""
    return range(1 if "--data-parallel=fsdp" in path else nproc)


def hold_before_last_batch(launch, path: list[str], nproc: int, straggler: int, max_steps: int):
    """A 3-group job whose ``straggler`` stops before its last batch: the job, the hold, and the straggler's PIDs."""
    job = launch(groups=3, nproc_per_group=nproc, worker_args=[f"--max-steps={max_steps}", *path, *GATES])
    hold = job.hold_from_step(straggler, max_steps - 1)
    start_together(job, groups=3, nproc=nproc)
    pids = [job.worker_pid(straggler, rank) for rank in range(nproc)]
    job.wait_for(
        f"group {straggler} to stop before its last batch",
        lambda: all(job.events("paused", pid=pid, phase="from_step") for pid in pids),
    )
    return job, hold, pids


@pytest.mark.parametrize(("path", "nproc", "straggler"), last_step_cases("ddp-group-0"))
def test_a_group_frozen_out_of_the_last_quorum_stops_instead_of_ending_as_a_second_model(
    launch, path, nproc, straggler
):
    """Group ``straggler`` is frozen (SIGSTOP) before its last batch, so its heartbeat lapses and the other two take
    the last step without it and finish. Let go, it meets nobody for its last quorum. It must not commit its last step
    alone (a second model at ``max_steps``, which it did before :mod:`lightning_ft.start.last_step`; checked with the
    check removed): it reads its peers' end reports, says so in one line, and exits 0 without a final state."""
    max_steps = 20
    job, hold, pids = hold_before_last_batch(launch, path, nproc, straggler, max_steps)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        hold.unlink()
        peers = [job.worker_pid(group, rank) for group in range(3) if group != straggler for rank in range(nproc)]
        job.wait_for("the other groups to finish and exit", lambda: all(map(process_gone, peers)), timeout=240)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert job.wait_exit() == 0, job.tail()
    states = job.final_states()
    ranks = state_ranks(path, nproc)
    assert sorted(states) == [(g, r) for g in range(3) if g != straggler for r in ranks], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == max_steps, (key, state["global_step"])
    assert_one_model(states, semi_sync="--algorithm" in " ".join(path))
    for pid in pids:
        assert job.events("job_already_finished", pid=pid), job.tail()
    said = [line for line in job.log_path.read_text().splitlines() if "stops before its last step" in line]
    assert said and all(f"[group {straggler}" in line for line in said), said


@pytest.mark.parametrize(("path", "nproc", "straggler"), last_step_cases("diloco-group-0"))
def test_a_live_group_late_for_the_last_quorum_takes_the_last_step_with_its_peers(launch, path, nproc, straggler):
    """Group ``straggler`` is held before its last batch, alive: it heartbeats, so the lighthouse forms the other
    groups' last quorums without it after each join timeout. They must not commit the last step without it while it
    lives (``last_step_deferred``); once it is let go it joins their next quorum, and all three groups commit the last
    step together: three final states, bit-identical, at ``max_steps``. Checked with the check removed: the two
    commit alone and finish, and the straggler commits its own last step (a second model)."""
    max_steps = 20
    job, hold, _ = hold_before_last_batch(launch, path, nproc, straggler, max_steps)
    peers = [group for group in range(3) if group != straggler]
    job.wait_for(
        "the other groups to take their last step again while the straggler lives",
        lambda: all(len(job.events("last_step_deferred", group=group, rank=0)) >= 2 for group in peers),
    )
    hold.unlink()
    assert job.wait_exit(timeout=240) == 0, job.tail()
    states = job.final_states()
    ranks = state_ranks(path, nproc)
    assert sorted(states) == [(g, r) for g in range(3) for r in ranks], sorted(states)
    for key, state in states.items():
        assert state["global_step"] == max_steps, (key, state["global_step"])
    assert_one_model(states, semi_sync="--algorithm" in " ".join(path))
    assert not job.events("job_already_finished"), job.tail()

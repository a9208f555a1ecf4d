"""Seeded random fault schedules on real jobs (``tests/support/fault_schedules.py``): the neighbours of the named
cases, drawn instead of written. ``make test`` runs a few fixed seeds, ``make test-extra`` more; a failing seed prints
the one command that replays it (``FAULT_SCHEDULE_SEEDS=<seed>`` replays any seed)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from fault_schedules import FaultSchedule, carry_out, check_invariants, generate, seeds_from_environment
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

# Chosen to cover every path, 2 and 3 groups, a group of 2 processes, kills in the last steps and again after a rejoin.
MAKE_TEST_SEEDS = [0]
EXTRA_SEEDS = list(range(1, 15))
# The same draws with every kill inside a validation's collective (generate(seed, sections=True)).
SECTION_SEEDS = list(range(0, 7))


def run_schedule(launch, schedule: FaultSchedule) -> None:
    said: list[str] = []
    job = launch(
        groups=schedule.groups,
        nproc_per_group=schedule.nproc,
        max_restarts=schedule.max_restarts,
        worker_args=[*schedule.worker_args, *GATES],
        launcher_args=schedule.launcher_args,
    )
    try:
        start_together(job, groups=schedule.groups, nproc=schedule.nproc)
        carry_out(job, schedule, said)
        check_invariants(job, schedule)
        assert any("killed pid" in line for line in said), "the schedule killed nothing: it tested nothing"
    except AssertionError as error:
        kills = "\n".join(said)
        raise AssertionError(
            f"{schedule.describe()}\nkills carried out:\n{kills}\nreplay: {schedule.replay_command()}\n{error}"
        ) from None
    print(schedule.describe(), *said, sep="\n")


def seeds(default: list[int]) -> list[int]:
    return seeds_from_environment(default)


@pytest.mark.parametrize("seed", seeds(MAKE_TEST_SEEDS), ids=lambda seed: f"seed-{seed}")
def test_a_random_fault_schedule_keeps_one_job_one_model(launch, seed):
    run_schedule(launch, generate(seed))


@pytest.mark.soak
@pytest.mark.parametrize("seed", seeds(EXTRA_SEEDS), ids=lambda seed: f"seed-{seed}")
def test_more_random_fault_schedules_keep_one_job_one_model(launch, seed):
    run_schedule(launch, generate(seed))


@pytest.mark.soak
@pytest.mark.parametrize("seed", seeds(SECTION_SEEDS), ids=lambda seed: f"seed-{seed}")
def test_kills_inside_sync_sections_keep_one_job_one_model(launch, seed):
    """A group killed inside a sync section's collective: the survivors take the section again on a quorum of their
    own, which may meet the victim's restart and groups already back in their steps (lightning_ft.manager.quorum_kind).
    """
    run_schedule(launch, generate(seed, sections=True))


def test_a_schedule_is_the_same_for_the_same_seed_and_covers_the_neighbours():
    assert generate(7) == generate(7)
    drawn = [generate(seed) for seed in range(200)]
    assert {s.path for s in drawn} == {"ddp", "ddp-sync-pg", "hsdp", "local_sgd", "diloco", "streaming_diloco"}
    assert {s.groups for s in drawn} == {2, 3} and {s.nproc for s in drawn} == {1, 2}
    kills = [(s, k) for s in drawn for k in s.kills]
    assert {k.point for _, k in kills} == {"batch_start", "quorum", "allreduce"}
    in_sections = [generate(seed, sections=True) for seed in range(200)]
    assert [replace(s, sections=False, kills=()) for s in in_sections] == [replace(s, kills=()) for s in drawn]
    assert {k.point for s in in_sections for k in s.kills} == {"section"}
    assert {s.path for s in in_sections[: len(SECTION_SEEDS)]} >= {"ddp", "hsdp", "local_sgd", "diloco"}
    assert {k.group for s, k in kills if s.groups == 3} == {0, 1, 2}
    assert any(k.step == s.max_steps - 1 for s, k in kills), "a kill in the job's last step"
    assert any(a.group == b.group and b.step == a.step + 1 for s in drawn for a, b in itertools.pairwise(s.kills)), (
        "a group killed again right after it rejoins"
    )
    left_out = [s for s in drawn if s.left_out is not None]
    assert {s.path for s in left_out} == {"ddp", "ddp-sync-pg", "hsdp"}
    for path in ("ddp", "hsdp"):
        assert any(s.path == path and s.left_out.step in {k.step for k in s.kills} for s in left_out), (
            f"{path}: a kill in a step that leaves part of the model out"
        )
    assert any(s.left_out.step == s.max_steps - 1 for s in left_out), "the last step leaves part of the model out"
    assert any(len(s.left_out.groups) == s.groups for s in left_out), "every group leaves it out"

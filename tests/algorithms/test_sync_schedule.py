"""``SyncSchedule`` (lightning_ft/algorithms/schedule.py): when a semi-synchronous group opens and finishes a sync."""

from __future__ import annotations

import pytest

from lightning_ft.algorithms.schedule import SyncSchedule


def run(schedule: SyncSchedule, steps: int) -> list[tuple[str, int]]:
    """What SyncCallback does at each batch start from inner step 1 (after the join at step 0), as it does it."""
    in_flight, done = False, []
    schedule.opened(0)
    schedule.finished(0)
    for step in range(1, steps + 1):
        if in_flight and schedule.finishes_in_flight(step):
            in_flight = False
            schedule.finished(step)
            done.append(("finish", step))
        if not in_flight and schedule.opens(step):
            schedule.opened(step)
            if schedule.overlapped:
                in_flight = True
                done.append(("open", step))
            else:
                schedule.finished(step)
                done.append(("sync", step))
    return done


def test_every_period_th_inner_step_syncs_whole_without_a_delay():
    assert run(SyncSchedule(period=4), 12) == [("sync", 4), ("sync", 8), ("sync", 12)]


def test_a_delayed_sync_opens_delay_steps_early_and_finishes_at_the_sync_step():
    assert run(SyncSchedule(period=4, delay=1), 12) == [
        ("open", 3),
        ("finish", 4),
        ("open", 7),
        ("finish", 8),
        ("open", 11),
        ("finish", 12),
    ]


@pytest.mark.parametrize(
    ("step", "committed", "delay", "move"),
    [
        (0, 0, 0, "finish"),  # the job's start: init_sync
        (8, 2, 0, "finish"),  # healed to the peers' sync step
        (6, 1, 0, "release"),  # every group resumed between two syncs
        (7, 1, 1, "prepare"),  # the opening step of a delayed sync
        (8, 2, 1, "finish"),  # a delayed sync's sync step (healed at its vote)
        (5, 1, 1, "release"),  # between a sync and the next opening
        (0, 0, 1, "finish"),
    ],
)
def test_a_first_batch_joins_where_its_peers_are(step, committed, delay, move):
    assert SyncSchedule(period=4, delay=delay).join(step, committed) == move


def test_training_ends_with_final_syncs_only_on_a_sync_step_not_yet_synced():
    schedule = SyncSchedule(period=4)
    assert not schedule.ends_with_final_syncs(10)
    assert schedule.ends_with_final_syncs(12)
    schedule.finished(12)
    assert not schedule.ends_with_final_syncs(12)


def test_a_sync_is_not_opened_twice_at_one_step():
    schedule = SyncSchedule(period=4)
    schedule.opened(8)
    assert not schedule.opens(8) and schedule.opens(12)

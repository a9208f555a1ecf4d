"""The check before a group's last vote (:mod:`lightning_ft.start.last_step`), in process, with a fake lighthouse.

The multi-process tests of the same rule (a group frozen out of the last quorum, a live group late for it) are in
``test_run_end.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable
from lightning_ft.manager.quorum_members import QuorumMembers
from lightning_ft.start.decision import JobAlreadyFinished
from lightning_ft.start.last_step import LAST_STEP_WAIT_S, LastStepCheck, LastStepDeferred, LastVote, last_vote
from lightning_ft_job.run_end import GroupFinished

PREFIX = "job_"


def report(group: int, step: int) -> GroupFinished:
    return GroupFinished("run", group, step, "max_steps=20 reached")


def status(*fresh: int) -> LighthouseStatus:
    return LighthouseStatus(quorum_id=7, heartbeats={f"{PREFIX}{g:04d}:uuid{g}": True for g in fresh})


@pytest.mark.parametrize("outsider", [0, 2])
def test_an_outsider_that_ended_the_run_at_this_step_or_later_stops_the_group(outsider):
    members = {0, 1, 2} - {outsider}
    for step in (20, 21):
        verdict = last_vote(status(*members), {outsider: report(outsider, step)}, members, PREFIX, 20)
        assert verdict == LastVote(ended=report(outsider, step))


def test_reports_of_the_quorums_own_members_and_of_earlier_steps_stop_nobody():
    """A member of the same quorum that voted first and finished already wrote its report: not a reason to stop."""
    reports = {1: report(1, 20), 2: report(2, 19)}
    assert last_vote(status(0, 1), reports, {0, 1}, PREFIX, 20) == LastVote()
    assert last_vote(status(0, 1, 2), reports, {0, 1}, PREFIX, 20) == LastVote(heartbeating=(2,))


def test_groups_of_another_job_on_the_same_lighthouse_are_not_outsiders():
    page = LighthouseStatus(quorum_id=1, heartbeats={"other_0003:u": True, f"{PREFIX}0001:u": True})
    assert last_vote(page, {}, {1}, PREFIX, 20) == LastVote()


class FakeManager:
    """What the check uses of a Manager; ``peers_defer``: another group of the quorum takes the step again."""

    def __init__(self, members: list[int], step: int = 19, peers_defer: bool = False) -> None:
        self._client = QuorumMembers(SimpleNamespace())
        self._client.quorum_replica_ids = tuple(f"{PREFIX}{g:04d}:u" for g in members)
        self.step = step
        self.errors: list[Exception] = []
        self.peers_defer = peers_defer
        self.exchanges = 0

    def allreduce(self, tensor, reduce_op=None) -> SimpleNamespace:  # the quorum's sum of deferral flags
        self.exchanges += 1
        tensor += float(self.peers_defer)
        return SimpleNamespace(wait=lambda: None)

    def errored(self) -> None:
        return None

    def wait_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)


def make_check(
    page, reports=None, global_step=19, max_steps=20, clock=lambda: 0.0, group=0, max_retries=None, **trainer_fields
):
    fields = dict(max_steps=max_steps, global_step=global_step, max_epochs=None, current_epoch=0) | trainer_fields
    fields.setdefault("strategy", SimpleNamespace(root_device=torch.device("cpu")))
    trainer = SimpleNamespace(**fields)
    settings = SimpleNamespace(
        lighthouse="http://lighthouse",
        num_replica_groups=3,
        replica_id_prefix=PREFIX,
        replica_group_id=group,
        max_retries=max_retries,
    )

    def read(_url: str) -> LighthouseStatus:
        if isinstance(page, Exception):
            raise page
        return page

    return LastStepCheck(trainer, settings, 0, lambda value: value, lambda: reports or {}, read, clock)


def test_the_last_vote_without_a_group_stops_after_its_report_and_defers_while_it_heartbeats():
    manager = FakeManager([0])
    with pytest.raises(JobAlreadyFinished) as stopped:
        make_check(status(0), {1: report(1, 20)}).before_vote(manager)
    assert stopped.value.step == 20
    make_check(status(0, 2)).before_vote(manager)
    assert [type(error) for error in manager.errors] == [LastStepDeferred]


def test_only_the_last_step_in_a_quorum_without_every_group_is_checked():
    """Earlier steps, or a quorum of every group, never read the lighthouse (a page that cannot be read would say)."""
    unread = AssertionError("read")
    make_check(unread, global_step=10).before_vote(FakeManager([0]))
    make_check(unread).before_vote(FakeManager([0, 1, 2]))
    make_check(unread, max_steps=-1).before_vote(FakeManager([0]))
    unreadable = make_check(StatusPageUnreadable("no page"))
    manager = FakeManager([0])
    unreadable.before_vote(manager)  # cannot check: commits, as without the check
    assert manager.errors == []


def test_a_heartbeating_outsider_is_waited_for_at_most_the_bound():
    now = [0.0]
    check = make_check(status(0, 1), clock=lambda: now[0])
    manager = FakeManager([0])
    check.before_vote(manager)
    now[0] = LAST_STEP_WAIT_S - 1
    check.before_vote(manager)
    assert len(manager.errors) == 2
    now[0] = LAST_STEP_WAIT_S
    check.before_vote(manager)
    assert len(manager.errors) == 2, "past the bound the group commits"


def test_the_last_batch_of_the_last_epoch_ends_the_fit_too():
    def ends(epoch: int, last_batch: bool) -> bool:
        check = make_check(status(0), max_steps=-1, max_epochs=2, current_epoch=epoch, is_last_batch=last_batch)
        return check.ends_the_fit()

    assert ends(1, True)
    assert not ends(1, False) and not ends(0, True)


def test_deferrals_stop_short_of_torchfts_max_retries():
    """torchft stops a group after ``max_retries`` uncommitted votes in a row: the check defers fewer times."""
    check = make_check(status(0, 1), max_retries=3)
    manager = FakeManager([0])
    assert [check.before_vote(manager) for _ in range(3)] == [False, False, True]
    assert len(manager.errors) == 2


def test_every_group_of_the_quorum_takes_the_last_step_again_when_one_of_them_defers():
    """Two groups of one quorum read the lighthouse at their own moments; an outsider's heartbeat may lapse between
    the two reads. The one that saw it lapsed must not commit while the other takes the step again (the frozen-group
    test saw that once: one group finished, the other stopped without a final state). Checked to fail without the
    exchange: the group commits."""
    lapsed = FakeManager([0, 2], peers_defer=True)
    make_check(status(0, 2)).before_vote(lapsed)  # this group sees no outsider heartbeat: it alone would commit
    assert [type(error) for error in lapsed.errors] == [LastStepDeferred] and lapsed.exchanges == 1
    agreed = FakeManager([0, 2])
    make_check(status(0, 2)).before_vote(agreed)
    assert agreed.errors == [] and agreed.exchanges == 1

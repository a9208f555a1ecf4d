"""Unit tests of where a group starts from (lightning_ft.start.decision), the job's durable record
(lightning_ft.start.record) and the lighthouse's status page (lightning_ft.manager.lighthouse_status)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import FakeClock
from helpers import trainer as make_trainer
from torchft._torchft import LighthouseClient, LighthouseServer

from lightning_ft import FTStrategy
from lightning_ft.manager.lighthouse_status import LighthouseStatus, StatusPageUnreadable, read_lighthouse_status
from lightning_ft.settings import FTConfigError
from lightning_ft.start.decision import (
    JobAlreadyFinished,
    StartContext,
    decide_start,
    finished_job,
)
from lightning_ft.start.record import JobRecord, durable_checkpoint_dirs
from lightning_ft.step.protocol import JobBehindCheckpointError, StepProtocol
from lightning_ft_job.events import ENV_RUN_ID

PREFIX = "lightning_ft_"


def replica(group: int, lifetime: str = "a") -> str:
    return f"{PREFIX}{group:05d}:{lifetime}"


# ---------------------------------------------------------------- the status page, from a real lighthouse
def test_the_status_page_of_a_real_lighthouse_names_the_quorum_its_steps_and_fresh_heartbeats():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    try:
        client = LighthouseClient(lighthouse.address(), timedelta(seconds=5))
        client.heartbeat(replica(0, "old-life"))
        client.quorum(
            replica(0, "old-life"), timedelta(seconds=5), address="a", store_address="b", step=7, world_size=1
        )
        deadline = time.monotonic() + 30
        while read_lighthouse_status(lighthouse.address()).heartbeats[replica(0, "old-life")]:  # until it is stale
            assert time.monotonic() < deadline, "the first lifetime's heartbeat never went stale"
            time.sleep(0.05)
        for _ in range(20):  # a fresh heartbeat, read back within the lighthouse's 1-s timeout (a busy machine may not)
            client.heartbeat(replica(1))
            client.heartbeat("another_job_00002:x")
            status = read_lighthouse_status(lighthouse.address())
            if status.heartbeats[replica(1)]:
                break
    finally:
        lighthouse.shutdown()
    assert status.quorum_id == 1
    assert status.previous_quorum == {replica(0, "old-life"): 7} and status.previous_quorum_id == 1
    assert status.member_addresses == {replica(0, "old-life"): "a"}  # what group_claim names as the host
    assert status.heartbeat_ages[replica(0, "old-life")] >= 1.0 > status.heartbeat_ages[replica(1)]
    assert status.heartbeats[replica(0, "old-life")] is False
    assert status.heartbeats[replica(1)] is True
    assert status.fresh_groups(PREFIX) == {1}
    assert status.live_member_steps(PREFIX, exclude_group=1) == []  # its only member is dead
    assert status.has_members_of(PREFIX)


def test_an_unreadable_status_page_names_the_address():
    with pytest.raises(StatusPageUnreadable, match=r"127\.0\.0\.1:9/status"):
        read_lighthouse_status("http://127.0.0.1:9", timeout=2)


# ---------------------------------------------------------------- the durable record
def test_checkpoints_only_move_forward(tmp_path):
    record = JobRecord([tmp_path])
    (tmp_path / "step=10.ckpt").write_bytes(b"x")
    record.record_save(tmp_path / "step=10.ckpt", 10)
    (tmp_path / "last.ckpt").write_bytes(b"x")
    record.record_save(tmp_path / "last.ckpt", 10)
    assert record.refuse_save(tmp_path / "last.ckpt", 10) is None  # the same step again (last.ckpt after step=N)
    assert record.refuse_save(tmp_path / "step=15.ckpt", 15) is None
    refusal = record.refuse_save(tmp_path / "last.ckpt", 3)
    assert refusal is not None and "committed step 10" in refusal and "step 3" in refusal
    newest = record.newest()
    assert newest is not None and newest.step == 10 and newest.path.name in ("step=10.ckpt", "last.ckpt")


def test_the_newest_checkpoint_is_one_still_on_disk(tmp_path):
    record = JobRecord([tmp_path])
    for step in (5, 10):
        (tmp_path / f"step={step}.ckpt").write_bytes(b"x")
        record.record_save(tmp_path / f"step={step}.ckpt", step)
    (tmp_path / "step=10.ckpt").unlink()
    assert record.newest() is not None and record.newest().step == 5
    record.record_removal(tmp_path / "step=5.ckpt")
    assert record.newest() is None
    assert JobRecord([]).newest() is None and not JobRecord([]).exists


def test_a_finished_job_applies_only_under_the_same_limits(tmp_path):
    record = JobRecord([tmp_path])
    assert finished_job(record, max_steps=30, max_epochs=None) is None
    record.mark_finished(step=30, epoch=0, max_steps=30, max_epochs=None, reason="max_steps=30 reached")
    finished = finished_job(record, max_steps=30, max_epochs=None)
    assert finished is not None and finished.step == 30 and finished.directory == tmp_path
    assert finished_job(record, max_steps=60, max_epochs=None) is None  # continued with a larger limit
    assert record.finished() is None  # ... which clears the record of the end


def test_durable_directories_are_the_ones_every_group_resolves_alike(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    fixed = ModelCheckpoint(dirpath=tmp_path / "fixed")
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[fixed], logger=CSVLogger(tmp_path), accelerator="cpu")
    assert durable_checkpoint_dirs(trainer) == [Path(os.path.realpath(tmp_path / "fixed"))]
    versioned = Trainer(default_root_dir=tmp_path, logger=CSVLogger(tmp_path), accelerator="cpu")
    assert durable_checkpoint_dirs(versioned) == []  # under the logger's version directory: one per process
    loggerless = Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu")
    assert durable_checkpoint_dirs(loggerless) == [Path(os.path.realpath(tmp_path / "checkpoints"))]


# ---------------------------------------------------------------- the decision, with a scripted lighthouse
def context(tmp_path: Path | None = None, **overrides) -> StartContext:
    values = dict(
        group=0,
        num_groups=2,
        prefix=PREFIX,
        lighthouse="http://lighthouse:1",
        start_timeout_s=5.0,
        attempt=0,
        record=JobRecord([tmp_path] if tmp_path else []),
    )
    values.update(overrides)
    return StartContext(**values)


def scripted(*readings: LighthouseStatus):
    """A status reader that returns the readings in turn, then the last one forever."""
    remaining = list(readings)

    def read(url: str) -> LighthouseStatus:
        return remaining.pop(0) if len(remaining) > 1 else remaining[0]

    return read


ALONE = LighthouseStatus(quorum_id=0, heartbeats={replica(0): True})
BOTH = LighthouseStatus(quorum_id=0, heartbeats={replica(0): True, replica(1): True})


def test_a_group_waits_until_every_group_heartbeats():
    clock = FakeClock()
    decision = decide_start(context(), scripted(ALONE, ALONE, ALONE, BOTH), clock, clock.sleep)
    assert decision.missing_groups == () and decision.resume_from is None and decision.error is None
    assert 0 < clock.now < 5.0


def test_the_start_timeout_bounds_the_wait_and_names_the_missing_groups(caplog):
    clock = FakeClock()
    decision = decide_start(context(num_groups=3), scripted(ALONE), clock, clock.sleep)
    assert decision.missing_groups == (1, 2)
    assert 5.0 <= clock.now < 5.5
    assert "replica groups [1, 2] did not start within start_timeout=5s" in caplog.text


def test_start_timeout_zero_starts_at_once():
    clock = FakeClock()
    decision = decide_start(context(start_timeout_s=0.0), scripted(ALONE), clock, clock.sleep)
    assert decision.missing_groups == (1,) and clock.now == 0.0


def test_groups_given_different_num_replica_groups_stop_at_once_naming_the_setting():
    """Group 2 heartbeats to a job this group was told has 2 groups: their data shards would overlap. The error
    comes at the first reading, not after start_timeout, while group 1 is still missing."""
    other_count = LighthouseStatus(quorum_id=0, heartbeats={replica(0): True, replica(2): True})
    clock = FakeClock()
    decision = decide_start(context(num_groups=2), scripted(other_count), clock, clock.sleep)
    assert clock.now == 0.0 and decision.config_error is not None, decision
    assert "replica group(s) [2]" in decision.config_error and "num_replica_groups=2" in decision.config_error
    assert "NUM_REPLICA_GROUPS" in decision.config_error and "FTStrategy(num_replica_groups=...)" in (
        decision.config_error
    )


def test_a_group_of_a_larger_count_joining_a_job_under_way_is_not_refused():
    under_way = LighthouseStatus(
        quorum_id=4, previous_quorum={replica(1): 12}, heartbeats={replica(0): True, replica(1): True, replica(2): True}
    )
    decision = decide_start(context(num_groups=2), scripted(under_way), FakeClock(), FakeClock().sleep)
    assert decision.config_error is None


def test_a_group_joining_a_job_under_way_does_not_wait():
    under_way = LighthouseStatus(
        quorum_id=4, previous_quorum={replica(1): 12}, heartbeats={replica(0): True, replica(1): True}
    )
    clock = FakeClock()
    decision = decide_start(context(num_groups=3), scripted(under_way), clock, clock.sleep)
    assert clock.now == 0.0 and decision.missing_groups == ()


def test_an_unreadable_lighthouse_starts_without_waiting(caplog):
    def unreadable(url: str) -> LighthouseStatus:
        raise StatusPageUnreadable("cannot read it")

    clock = FakeClock()
    decision = decide_start(context(attempt=1), unreadable, clock, clock.sleep)
    assert decision.error is None and clock.now == 0.0
    assert "cannot tell which replica groups are up" in caplog.text


def saved(tmp_path: Path, step: int) -> Path:
    path = tmp_path / f"step={step}.ckpt"
    path.write_bytes(b"x")
    JobRecord([tmp_path]).record_save(path, step)
    return path


def test_no_live_peer_ahead_resumes_from_the_newest_checkpoint(tmp_path):
    path = saved(tmp_path, 20)
    everyone_dead = LighthouseStatus(
        quorum_id=9,
        previous_quorum={replica(0, "dead"): 55, replica(1, "dead"): 55},
        heartbeats={replica(0, "dead"): False, replica(1, "dead"): False, replica(0): True, replica(1): True},
    )
    clock = FakeClock()
    decision = decide_start(context(tmp_path, attempt=1), scripted(everyone_dead), clock, clock.sleep)
    assert decision.resume_from == path and decision.floor_step == 20


def test_a_live_peer_ahead_of_the_checkpoint_heals_the_group_instead(tmp_path):
    saved(tmp_path, 20)
    peer_ahead = LighthouseStatus(
        quorum_id=9, previous_quorum={replica(1): 23}, heartbeats={replica(0): True, replica(1): True}
    )
    clock = FakeClock()
    decision = decide_start(context(tmp_path, attempt=1), scripted(peer_ahead), clock, clock.sleep)
    assert decision.resume_from is None and decision.floor_step == 20  # nothing read from disk; the floor holds


def test_a_restarted_group_without_a_record_or_a_peer_gets_the_error_after_waiting():
    dead_peer = LighthouseStatus(
        quorum_id=3, previous_quorum={replica(1): 40}, heartbeats={replica(1): False, replica(0): True}
    )
    clock = FakeClock()
    decision = decide_start(context(attempt=1), scripted(dead_peer), clock, clock.sleep)
    assert clock.now >= 5.0  # it waited start_timeout for a peer first
    assert decision.error is not None and "found no live replica group within start_timeout=5s" in decision.error
    assert "ModelCheckpoint with a fixed dirpath" in decision.error
    clock = FakeClock()
    fresh_start = decide_start(context(), scripted(ALONE), clock, clock.sleep)
    assert fresh_start.error is None  # a job's first start with one group up is not an error
    one_group = decide_start(context(num_groups=1, attempt=1), scripted(ALONE), clock, clock.sleep)
    assert one_group.error is None  # a job of one group has no peer to wait for


def test_a_restarted_group_without_a_record_must_reach_the_step_of_the_jobs_last_quorum():
    live_peer = LighthouseStatus(
        quorum_id=3, previous_quorum={replica(1): 40}, heartbeats={replica(1): True, replica(0): True}
    )
    clock = FakeClock()
    decision = decide_start(context(attempt=1), scripted(live_peer), clock, clock.sleep)
    assert decision.error is None and decision.resume_from is None
    assert decision.floor_step == 40 and decision.floor_source == "the job's last quorum"


# ---------------------------------------------------------------- the first quorum's floor
class FakeManager:
    def __init__(self, step_after_quorum: int, errored: bool = False) -> None:
        self.step = 0
        self.step_after_quorum = step_after_quorum
        self._errored = errored

    def start_quorum(self) -> None:
        pass

    def wait_quorum(self) -> None:
        self.step = self.step_after_quorum

    def current_step(self) -> int:
        return self.step

    def errored(self):
        return object() if self._errored else None


def test_a_first_quorum_behind_the_checkpoint_stops_the_group():
    protocol = StepProtocol(FakeManager(step_after_quorum=0))
    protocol.require_floor(20)
    with pytest.raises(
        JobBehindCheckpointError, match="at committed step 0, behind step 20 that the job had already reached"
    ):
        protocol.open_quorum()


def test_a_first_quorum_at_the_checkpoint_clears_the_floor_and_a_failed_heal_retries():
    protocol = StepProtocol(FakeManager(step_after_quorum=23))
    protocol.require_floor(20)
    protocol.open_quorum()
    assert protocol.floor_step is None
    failed = StepProtocol(FakeManager(step_after_quorum=0, errored=True))
    failed.require_floor(20)
    failed.open_quorum()  # the step will not commit; the next quorum checks again
    assert failed.floor_step == 20


# ---------------------------------------------------------------- the setting
def test_start_timeout_from_the_argument_the_environment_or_the_default(monkeypatch):
    def resolve_settings(**arguments):
        return FTStrategy(**arguments).settings

    base: dict = {}
    monkeypatch.delenv("LIGHTNING_FT_START_TIMEOUT", raising=False)
    assert resolve_settings(**base).start_timeout == timedelta(seconds=300)
    assert resolve_settings(**base, start_timeout=0).start_timeout == timedelta(0)
    monkeypatch.setenv("LIGHTNING_FT_START_TIMEOUT", "12.5")
    assert resolve_settings(**base).start_timeout == timedelta(seconds=12.5)
    assert resolve_settings(**base, start_timeout=3).start_timeout == timedelta(seconds=3)
    monkeypatch.setenv("LIGHTNING_FT_START_TIMEOUT", "soon")
    with pytest.raises(FTConfigError, match="LIGHTNING_FT_START_TIMEOUT='soon' is not a number"):
        resolve_settings(**base)
    with pytest.raises(FTConfigError, match="start_timeout=-1: must be 0 or more seconds"):
        resolve_settings(**base, start_timeout=-1)


# ---------------------------------------------------------------- in a real fit (one group, embedded lighthouse)
def fit(root: Path, max_steps: int, every: int, ckpt_path: str | None = None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ft import FTStrategy

    saves = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1, save_last=True)
    trainer = make_trainer(FTStrategy(), [saves], max_steps=max_steps, default_root_dir=root, enable_checkpointing=True)
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)


@pytest.mark.timeout(180)
def test_a_writer_behind_the_job_writes_nothing_and_a_finished_job_is_not_trained_again(tmp_path, caplog, monkeypatch):
    """One run (a launcher's run id) fitted again and again in one folder, as its restarts are; then a new run."""
    monkeypatch.setenv(ENV_RUN_ID, "run-1")
    fit(tmp_path, max_steps=10, every=5)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / ".lightning_ft" / "finished.json").exists()
    written = {path.name: path.stat().st_mtime_ns for path in ckpt.glob("*.ckpt")}

    with pytest.raises(JobAlreadyFinished) as finished:  # the same run again: it has finished
        fit(tmp_path, max_steps=10, every=1)
    assert finished.value.step == 10
    assert {path.name: path.stat().st_mtime_ns for path in ckpt.glob("*.ckpt")} == written
    assert "already finished at committed step 10" in caplog.text

    # Continued from an older checkpoint with a larger limit: steps 6..9 are behind the job's step 10 and are not
    # written (one warning); from step 10 on, saves go ahead.
    caplog.clear()
    fit(tmp_path, max_steps=12, every=1, ckpt_path=str(ckpt / "epoch=0-step=5.ckpt"))
    names = sorted(path.name for path in ckpt.glob("*.ckpt"))
    assert not [name for name in names if name in {f"epoch=0-step={s}.ckpt" for s in range(6, 10)}], names
    assert {"epoch=0-step=11.ckpt", "epoch=0-step=12.ckpt"} <= set(names)
    assert caplog.text.count("not writing") == 1
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 12

    # A new run in the same folder trains the model it is given, says whose checkpoints it leaves, and saves beside
    # them under Lightning's versioned names.
    caplog.clear()
    monkeypatch.setenv(ENV_RUN_ID, "run-2")
    fit(tmp_path, max_steps=3, every=3)
    assert "holds the checkpoints of run run-1; this run (run-2) trains the model it was given" in caplog.text
    assert torch.load(ckpt / "last-v1.ckpt", weights_only=False)["global_step"] == 3
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 12

"""Observability: the ``ft/`` metrics reach the Trainer's loggers, the progress bar shows ``replicas P/N``, the event
log is on by default under the run's directory, and ``lightning-ft report`` draws it.

The fits are in process, on one real replica group (real Manager, in-process lighthouse, gloo), as in
test_step_semantics.py. Only the report command runs as a subprocess, as users run it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import REPO
from helpers import trainer as make_trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import FaultToleranceMonitor, FTStrategy
from lightning_ft.manager import QuorumSeen
from lightning_ft.manager.telemetry import FTTelemetry, TimedTransport
from lightning_ft_cli import report
from lightning_ft_cli.launch import status_page_line
from lightning_ft_cli.timeline import NoEventLogError, load_timeline
from lightning_ft_job.events import ENV_EVENTS_DIR, ENV_RUN_ID, RUN_POINTER, read_events, resolve_directory

pytestmark = pytest.mark.timeout(240)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader() -> DataLoader:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


class RecordProgressBar(pl.Callback):
    """What the progress bar would show after every batch: its ``get_metrics``, as the bar itself calls it."""

    def __init__(self) -> None:
        self.shown: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.shown.append(trainer.progress_bar_callback.get_metrics(trainer, pl_module))


class RejectOneStep(pl.Callback):
    """Reports an error to the Manager before the vote of batch ``index``, as a failed cross-group allreduce does."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.index:
            trainer.strategy.manager.report_error(RuntimeError("injected: cross-group allreduce failed"))


@pytest.fixture
def single_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica group with the embedded lighthouse, and the event log at its default location (each ``fit`` below
    gives its run an id, as a launcher does)."""
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", ENV_EVENTS_DIR, ENV_RUN_ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


_runs = iter(range(1_000_000))


def fit(root: Path, *callbacks: pl.Callback, max_steps: int, **kwargs: Any) -> pl.Trainer:
    # A run of its own, as a launcher would name it: a fit without a run id writes no event log.
    os.environ[ENV_RUN_ID] = f"run-{next(_runs)}"  # removed again by single_group's monkeypatch
    kwargs.setdefault("logger", CSVLogger(root))
    trainer = pl.Trainer(
        strategy=FTStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=root,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(Regressor(), loader())
    return trainer


def ft_rows(log_dir: str) -> list[dict[str, float]]:
    """The rows of metrics.csv that carry the ``ft/`` metrics, as numbers."""
    with open(Path(log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    return [
        {key: float(value) for key, value in row.items() if value != ""} for row in rows if row.get("ft/participants")
    ]


def run_report(run_dir: Path, output: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lightning_ft_cli", "report", str(run_dir), "-o", str(output)]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO)


@pytest.mark.multiprocess  # the report command, as users run it
def test_ft_metrics_reach_a_csv_logger_the_progress_bar_shows_replicas_and_the_report_draws_the_run(
    tmp_path, single_group
):
    bar = RecordProgressBar()
    trainer = fit(tmp_path, bar, TQDMProgressBar(), max_steps=8)
    assert trainer.global_step == 8

    # The ft/ metrics in the CSVLogger's metrics.csv, at every logged (committed) step, with sane values.
    rows = ft_rows(trainer.log_dir)
    assert len(rows) == 8
    assert [row["step"] for row in rows] == list(range(8))  # Lightning's step of each batch: its committed count
    assert [row["ft/committed_steps"] for row in rows] == list(range(1, 9))
    for row in rows:
        assert row["ft/participants"] == 1
        assert row["ft/uncommitted_steps"] == 0 and row["ft/non_finite_skips"] == 0
        assert row["ft/heals"] == 0 and "ft/heal_seconds" not in row
        assert row["ft/batches_committed"] == row["ft/committed_steps"]  # one participant per committed step
        assert 0 <= row["ft/quorum_wait_seconds"] <= row["ft/quorum_wait_seconds_total"]
    totals = [row["ft/quorum_wait_seconds_total"] for row in rows]
    assert totals == sorted(totals)

    # The progress bar: replicas 1/1, next to Lightning's own items, on the bar Lightning built.
    assert bar.shown and all(items["replicas"] == "1/1" and "v_num" in items for items in bar.shown)
    assert "get_metrics" not in vars(trainer.progress_bar_callback), "the wrapper outlived the fit"

    # The event log, on by default, in this run's own directory under the Trainer's default_root_dir.
    [run_dir] = [d for d in (tmp_path / "ft_events").iterdir() if d.is_dir()]
    records = read_events(run_dir)
    kinds = [r["event"] for r in records]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert records[0]["replica_groups"] == 1
    [quorum] = [r for r in records if r["event"] == "quorum"]
    assert quorum["participants"] == 1
    # One membership throughout, so one quorum: every logged step reports the id the event log recorded for it.
    assert {row["ft/quorum_id"] for row in rows} == {quorum["quorum_id"]}
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["committed"] and isinstance(r["loss"], float) for r in steps)
    assert "fingerprint" not in records[-1]  # a full pass over the state only when the log is asked for explicitly

    # lightning-ft report, given the logger's log directory: the run it points at.
    output = tmp_path / "timeline.png"
    result = run_report(Path(trainer.log_dir), output)
    assert result.returncode == 0, result.stdout + result.stderr
    assert output.read_bytes().startswith(PNG_SIGNATURE) and output.stat().st_size > 10_000
    assert "group 0: 8 committed steps (up to 8), 0 uncommitted" in result.stdout
    assert f"event logs: {run_dir.resolve()}" in result.stdout


def test_a_second_run_in_the_same_directory_has_its_own_event_log_and_report_draws_one_run(tmp_path, single_group):
    """Two fits with one default_root_dir and a CSVLogger (version_0, version_1): each run writes its own event
    directory, the second leaves the first's files as they were, and the report draws one run: the one a logger's
    directory points at, and the newest for the root."""
    first = fit(tmp_path, max_steps=3, enable_progress_bar=False)
    [first_run] = [d for d in (tmp_path / "ft_events").iterdir() if d.is_dir()]
    before = {f.name: f.read_bytes() for f in first_run.iterdir()}
    second = fit(tmp_path, max_steps=5, enable_progress_bar=False)
    assert Path(first.log_dir).name == "version_0" and Path(second.log_dir).name == "version_1"
    [second_run] = [d for d in (tmp_path / "ft_events").iterdir() if d.is_dir() and d != first_run]
    assert {f.name: f.read_bytes() for f in first_run.iterdir()} == before, "the second run touched the first's log"
    assert (Path(first.log_dir) / RUN_POINTER).is_file() and (Path(second.log_dir) / RUN_POINTER).is_file()
    assert load_timeline(first.log_dir).committed_steps == 3
    assert load_timeline(second.log_dir).committed_steps == 5
    newest = load_timeline(tmp_path)
    assert newest.sources == [second_run.resolve()] and newest.other_runs == [first_run.name]
    assert load_timeline(tmp_path, run=first_run.name).committed_steps == 3
    with pytest.raises(NoEventLogError, match="no run named 'nope'"):
        load_timeline(tmp_path, run="nope")


def test_an_uncommitted_step_is_counted_logged_and_recorded_with_its_error(tmp_path, single_group):
    trainer = fit(tmp_path, RejectOneStep(index=2), max_steps=4, enable_progress_bar=False)
    assert trainer.global_step == 4
    rows = ft_rows(trainer.log_dir)
    assert [row["ft/uncommitted_steps"] for row in rows] == [0, 0, 1, 1, 1]
    assert [row["ft/committed_steps"] for row in rows] == [1, 2, 2, 3, 4]
    [run_dir] = [d for d in (tmp_path / "ft_events").iterdir() if d.is_dir()]
    [uncommitted] = [r for r in read_events(run_dir) if r["event"] == "step" and not r["committed"]]
    assert uncommitted["step"] == 2 and "injected: cross-group allreduce failed" in uncommitted["error"]
    [group] = load_timeline(tmp_path).groups.values()
    assert [(mark.kind, mark.step) for mark in group.failures] == [("uncommitted", 2)]


@pytest.mark.parametrize("bar_kind", ["tqdm", "rich"])
def test_the_progress_bar_counts_committed_batches_and_ends_at_its_total(tmp_path, single_group, bar_kind):
    """Batch 2's step does not commit: Lightning runs 5 batches for 4 steps. The bar ends at 4/4, not 5/4."""
    from lightning.pytorch.callbacks import RichProgressBar

    class FinalCount(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            bar = trainer.progress_bar_callback
            if isinstance(bar, RichProgressBar):
                task = bar.progress.tasks[bar.train_progress_bar_id]
                self.count = (task.completed, task.total)
            else:
                self.count = (bar.train_progress_bar.n, bar.train_progress_bar.total)

    final = FinalCount()
    bar = RichProgressBar() if bar_kind == "rich" else TQDMProgressBar()
    trainer = fit(tmp_path, RejectOneStep(index=2), bar, final, max_steps=4, logger=False)
    assert trainer.global_step == 4 and trainer.fit_loop.epoch_loop.batch_idx == 4  # 5 batches ran
    assert final.count == (4, 4)


def test_the_rich_progress_bar_shows_replicas_too(tmp_path, single_group):
    from lightning.pytorch.callbacks import RichProgressBar  # rich is in the test extra: this always runs

    bar = RecordProgressBar()
    fit(tmp_path, bar, RichProgressBar(), max_steps=2, logger=False)
    assert bar.shown and all(items["replicas"] == "1/1" for items in bar.shown)


def test_the_monitor_logs_nothing_without_loggers_and_no_bar_is_needed(tmp_path, single_group):
    """``logger=False`` and no progress bar: the monitor still runs (added by default) and breaks nothing."""
    trainer = make_trainer(FTStrategy(), max_steps=2, default_root_dir=tmp_path)
    trainer.fit(Regressor(), loader())
    assert any(isinstance(callback, FaultToleranceMonitor) for callback in trainer.callbacks)
    assert not any(key.startswith("ft/") for key in trainer.callback_metrics)


def test_the_event_log_location_env_var_wins_and_empty_turns_it_off(tmp_path, monkeypatch):
    for name in (ENV_EVENTS_DIR, ENV_RUN_ID, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    one, another = resolve_directory(tmp_path), resolve_directory(tmp_path)
    assert one.parent == another.parent == tmp_path / "ft_events" and one != another, "a new run id per fit"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's placeholder without --rdzv-id: not an id
    assert resolve_directory(tmp_path).name != "none"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "f00d")  # the same for every restart of one torchrun job
    assert resolve_directory(tmp_path) == tmp_path / "ft_events" / "f00d"
    monkeypatch.setenv(ENV_RUN_ID, "20261126-job")  # the launcher's, the same for every group: it wins
    assert resolve_directory(tmp_path) == tmp_path / "ft_events" / "20261126-job"
    assert resolve_directory("s3://bucket/run") is None  # appending line by line needs a local file
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "elsewhere"))
    assert resolve_directory(tmp_path) == tmp_path / "elsewhere"
    monkeypatch.setenv(ENV_EVENTS_DIR, "")
    assert resolve_directory(tmp_path) is None


def write_log(directory: Path, group: int, records: list[dict[str, Any]], rank: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"group{group}.rank{rank}.jsonl", "a") as file:
        for record in records:
            file.write(json.dumps({"group": group, "rank": rank, **record}) + "\n")


def two_group_run(directory: Path) -> None:
    """Group 1 is killed after step 3 (its process leaves no word), restarts and heals at step 5; group 0 skips
    step 4 (a non-finite gradient) and trains alone in between."""
    step = lambda t, pid, s, p, ok=True: {"event": "step", "time": t, "pid": pid, "step": s, "committed": ok,  # noqa: E731
                                          "participants": p, "loss": 1.0 / (s + 1)}  # fmt: skip
    write_log(directory, 0, [
        {"event": "started", "time": 0.0, "pid": 10, "attempt": 0, "replica_groups": 2},
        step(1.0, 10, 1, 2), step(2.0, 10, 2, 2), step(3.0, 10, 3, 2),
        {"event": "step_rejected", "time": 4.0, "pid": 10, "step": 3, "reason": "not finite"},
        step(4.0, 10, 3, 1, ok=False), step(5.0, 10, 4, 1), step(6.0, 10, 5, 1), step(8.0, 10, 6, 2),
        {"event": "finished", "time": 9.0, "pid": 10, "step": 6},
    ])  # fmt: skip
    write_log(directory, 1, [
        {"event": "started", "time": 0.1, "pid": 20, "attempt": 0, "replica_groups": 2},
        step(1.0, 20, 1, 2), step(2.0, 20, 2, 2), step(3.0, 20, 3, 2),
        {"event": "started", "time": 6.5, "pid": 21, "attempt": 1, "replica_groups": 2},
        {"event": "healed", "time": 7.5, "pid": 21, "step": 5, "seconds": 0.25},
        step(8.0, 21, 6, 2),
        {"event": "finished", "time": 9.0, "pid": 21, "step": 6},
    ])  # fmt: skip
    write_log(directory, 1, [{"event": "started", "time": 0.1, "pid": 22, "attempt": 0}], rank=1)  # ignored


def test_the_timeline_finds_heals_skips_and_deaths(tmp_path):
    two_group_run(tmp_path / "run" / "events")
    timeline = load_timeline(tmp_path / "run")
    assert timeline.num_replica_groups == 2 and timeline.committed_steps == 6 and timeline.start == 0.0
    group0, group1 = timeline.groups[0], timeline.groups[1]
    assert [(m.kind, m.step) for m in group0.failures] == [("skipped", 3)]  # not also "uncommitted"
    assert [(m.kind, m.step) for m in group1.failures] == [("died", 3)]  # at the job's step when it went quiet
    assert [(m.kind, m.step, m.detail) for m in group1.heals] == [("heal", 5, "0.25 s")]
    assert group0.participants_at(5.5) == 1 and group1.processes == 2
    assert report.headline(timeline) == (
        "2 replica groups, 6 committed steps, 1 process death, 0 uncommitted steps, 1 skipped step, 1 heal"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoEventLogError, match="no event log"):
        load_timeline(tmp_path / "empty")


def test_a_checkpoint_directory_finds_the_newest_run_of_its_root_and_an_events_dir_is_its_own_run(tmp_path):
    """``ft_events`` with an old run in the layout before per-run directories (files directly in it) and a newer run
    directory: the root's checkpoint directory draws the newest; each is also drawn when named or given directly."""
    events_root = tmp_path / "ft_events"
    write_log(events_root, 0, [{"event": "started", "time": 0.0, "pid": 1, "attempt": 0}])
    an_hour_ago = time.time() - 3600
    os.utime(events_root / "group0.rank0.jsonl", (an_hour_ago, an_hour_ago))  # the newer run's files are newer
    two_group_run(events_root / "20261126-101010-abc123")
    (tmp_path / "checkpoints").mkdir()
    newest = load_timeline(tmp_path / "checkpoints")
    assert newest.sources == [(events_root / "20261126-101010-abc123").resolve()] and newest.committed_steps == 6
    assert newest.other_runs == ["ft_events"]
    assert load_timeline(events_root / "20261126-101010-abc123").other_runs == []
    assert load_timeline(tmp_path, run="ft_events").committed_steps == 0


def test_the_headline_counts_a_death_and_its_lost_step_apart_and_no_initial_sync_as_a_heal(tmp_path):
    """Two kills: each costs the survivor an uncommitted step; the late starter's step-0 sync is no heal."""
    step = lambda t, pid, s, ok=True: {"event": "step", "time": t, "pid": pid, "step": s, "committed": ok,  # noqa: E731
                                       "participants": 2}  # fmt: skip
    write_log(tmp_path, 0, [
        {"event": "started", "time": 0.0, "pid": 10, "attempt": 0, "replica_groups": 2},
        step(1.0, 10, 1), step(2.0, 10, 1, ok=False), step(3.0, 10, 2), step(4.0, 10, 2, ok=False), step(5.0, 10, 3),
        {"event": "finished", "time": 9.0, "pid": 10, "step": 3},
    ])  # fmt: skip
    write_log(tmp_path, 1, [
        {"event": "started", "time": 0.5, "pid": 20, "attempt": 0, "replica_groups": 2},
        {"event": "healed", "time": 0.9, "pid": 20, "step": 0, "seconds": 0.1},
        {"event": "started", "time": 2.5, "pid": 21, "attempt": 1, "replica_groups": 2},
        {"event": "healed", "time": 2.9, "pid": 21, "step": 2, "seconds": 0.1},
        {"event": "started", "time": 4.5, "pid": 22, "attempt": 2, "replica_groups": 2},
        {"event": "healed", "time": 4.9, "pid": 22, "step": 3, "seconds": 0.1},
        {"event": "finished", "time": 9.0, "pid": 22, "step": 3},
    ])  # fmt: skip
    assert report.headline(load_timeline(tmp_path)) == (
        "2 replica groups, 3 committed steps, 2 process deaths, 2 uncommitted steps, 2 heals, 1 initial sync"
    )


def test_the_reports_words_say_what_its_picture_says_and_its_title_names_the_run(tmp_path, monkeypatch, capsys):
    """The summary's heals are the picture's heals (a late starter's step-0 sync is an initial sync in both), and
    the title is the run's id, also for ``lightning-ft report .``. Checked to fail at 6bcf74e: the summary listed
    "heals: step 0 (0.1 s), ..." beside "2 heals, 1 initial sync", and the title was "."."""
    test_the_headline_counts_a_death_and_its_lost_step_apart_and_no_initial_sync_as_a_heal(
        tmp_path / "ft_events" / "r1"
    )
    with open(tmp_path / "ft_events" / "r1" / "group0.rank0.jsonl", "a") as file:  # the run id its groups logged
        file.write(
            json.dumps({"group": 0, "rank": 0, "event": "started", "time": 0.0, "pid": 10, "run": "r-42"}) + "\n"
        )
    titles: list[str] = []
    monkeypatch.setattr(report, "render", lambda timeline, output, title="": titles.append(title))
    monkeypatch.chdir(tmp_path)
    assert report.run(report_args(Path("."), tmp_path / "timeline.png")) == 0
    said = capsys.readouterr().out
    timeline = load_timeline(tmp_path)
    headline = report.headline(timeline)
    assert titles == ["run r-42"], titles
    assert "2 heals, 1 initial sync" in headline
    assert "heals: step 2 (0.10 s), step 3 (0.10 s); 1 initial sync from a peer" in said, said
    assert "step 0" not in said, said
    words = sum(len(report.split_heals(group.heals)[0]) for group in timeline.groups.values())
    assert f"{words} heals" in headline


def test_report_draws_a_png_and_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    two_group_run(tmp_path / "events")
    args = report_args(tmp_path, tmp_path / "out" / "timeline.png")
    assert report.run(args) == 0
    assert (tmp_path / "out" / "timeline.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (
        "group 1: 4 committed steps (up to 6), 0 uncommitted, 0 skipped, 1 process deaths, 2 process(es); "
        "heals: step 5 (0.25 s)"
    ) in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if it were not installed
    assert report.run(report_args(tmp_path, tmp_path / "again.png")) == 2
    assert "pip install matplotlib (the report extra" in capsys.readouterr().err
    assert not (tmp_path / "again.png").exists()


def report_args(run_dir: Path, output: Path) -> Any:
    from lightning_ft_cli.main import build_parser

    return build_parser().parse_args(["report", str(run_dir), "-o", str(output)])


def test_the_launcher_names_the_lighthouse_status_page():
    assert status_page_line("http://127.0.0.1:29510") == (
        "lighthouse status page: http://127.0.0.1:29510/ (open in a browser: quorum, participants, heartbeats)"
    )


RECEIVE_S = 0.05


class FakeTransport:
    """Stands in for a checkpoint transport: records what reaches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def metadata(self) -> str:
        return "meta"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, int]:
        self.calls.append(f"recv {src_rank} {metadata} {step}")
        time.sleep(RECEIVE_S)
        return {"step": step}

    def extra(self) -> str:
        return "extra"


def test_the_timed_transport_delegates_and_times_each_receive_once():
    inner = FakeTransport()
    transport = TimedTransport(inner)  # type: ignore[arg-type]
    assert transport.take_receive()[0] is None
    assert transport.recv_checkpoint(src_rank=1, metadata="meta", step=7, timeout=timedelta(seconds=1)) == {"step": 7}
    assert inner.calls == ["recv 1 meta 7"] and transport.metadata() == "meta" and transport.extra() == "extra"
    seconds = transport.take_receive()[0]
    assert seconds is not None and seconds >= RECEIVE_S  # the receive's own duration, not the time since anything else
    assert transport.take_receive()[0] is None
    transport.recv_checkpoint(src_rank=2, metadata="meta", step=8, timeout=timedelta(seconds=1))
    seconds, source = transport.take_receive()
    assert seconds is not None and source == 2  # the sender's replica rank, for the healed event
    assert transport.take_receive() == (None, None)


class FakeManager:
    """The part of FTManager that FTTelemetry uses."""

    def __init__(self) -> None:
        self.observers: list[object] = []

    def add_quorum_observer(self, observer: object) -> None:
        self.observers.append(observer)

    def current_step(self) -> int:
        return 3


def test_telemetry_times_quorum_waits_and_tells_the_replica_status():
    manager = FakeManager()
    telemetry = FTTelemetry(manager, None, num_replica_groups=2)  # type: ignore[arg-type]
    assert manager.observers == [telemetry]
    assert telemetry.replicas() is None  # before the first quorum
    telemetry.step_started()
    telemetry.quorum_waited(0.25)
    telemetry.quorum_formed(QuorumSeen(quorum_id=7, participants=1, replica_rank=0))
    assert telemetry.replicas() == "1/2" and telemetry.quorum_id == 7
    assert telemetry.step_quorum_wait_seconds == telemetry.quorum_wait_seconds_total == 0.25
    telemetry.step_started()
    telemetry.quorum_waited(0.5)
    assert telemetry.step_quorum_wait_seconds == 0.5 and telemetry.quorum_wait_seconds_total == 0.75
    telemetry.quorum_formed(QuorumSeen(quorum_id=8, participants=2, replica_rank=1))
    assert telemetry.replicas() == "2/2"
    telemetry.step_voted(False)
    telemetry.step_voted(True)
    assert telemetry.uncommitted_steps == 1
    heal = telemetry.healed(step=5, apply_seconds=0.5)
    assert heal.receive_seconds is None and heal.seconds == 0.5 and telemetry.heals == [heal]

"""The zoo's split of FTStrategy's fixed cost (benchmarks/zoo/zoo.py, ``floor_split``): torchft's protocol beside
DDPStrategy against lightning-ft above it, per repetition, only where a repetition ran every mode it needs."""

from __future__ import annotations

import pytest

from benchmarks.zoo.zoo import floor_split, floor_table


def run(mode: str, rep: int, step_ms: float, cpu_ms: float, vote_ms: float | None = None) -> dict[str, object]:
    record: dict[str, object] = {
        "mode": mode,
        "model": "mlp-0.3m",
        "accumulate": 1,
        "rep": rep,
        "step_s": step_ms / 1000,
        "job_cpu_per_step_s": cpu_ms / 1000,
    }
    if vote_ms is not None:
        record["vote_ms"] = vote_ms
    return record


def test_the_split_takes_each_repetitions_own_baseline_and_medians_over_repetitions():
    runs = [
        # rep 0: the protocol costs 1 ms, lightning-ft 0.5 ms more; rep 1 on a slower machine: 3 ms and -1 ms
        run("ddp", 0, 10.0, 20.0),
        run("ddp_torchft", 0, 11.0, 22.0, vote_ms=0.5),
        run("ft", 0, 11.5, 23.0, 0.2),
        run("ddp", 1, 20.0, 40.0),
        run("ddp_torchft", 1, 23.0, 43.0, vote_ms=0.7),
        run("ft", 1, 22.0, 42.0, 0.1),
        run("ddp", 2, 30.0, 60.0),
        run("ft", 2, 99.0, 99.0),  # no floor arm in rep 2: not in the split
    ]
    (row,) = floor_split({"a.json": runs}, "ddp_torchft")
    assert row["repetitions"] == 2
    assert row["floor_wall_ms"] == pytest.approx(2.0) and row["above_wall_ms"] == pytest.approx(-0.25)
    assert row["ft_wall_ms"] == pytest.approx(1.75) and row["ft_cpu_ms"] == pytest.approx(2.5)
    assert row["floor_vote_ms"] == pytest.approx(0.6) and row["ft_vote_ms"] == pytest.approx(0.15)
    assert sorted(row["floor_wall_ms_each"]) == [1.0, 3.0]
    assert "+1.75 ms" in floor_table([row], "torchft's quorum and vote")


def test_a_file_without_the_floor_mode_gives_no_row():
    assert floor_split({"a.json": [run("ddp", 0, 10.0, 20.0), run("ft", 0, 11.0, 21.0)]}, "ddp_quorum") == []


def test_every_benchmark_process_runs_with_the_threads_the_launcher_gives_its_groups(monkeypatch):
    """A raw torchft Manager under torchrun (the zoo's floor modes) must run as lightning-ft's groups do: with tokio's
    default threads instead, the floor measured torchft with twice the runtime threads that FTStrategy has."""
    from benchmarks.common.run_util import bench_env
    from lightning_ft_cli.group_environment import GROUP_THREADS, group_environment

    for name in GROUP_THREADS:  # unset here, as in a shell that never set them
        monkeypatch.delenv(name, raising=False)
    assert GROUP_THREADS["TOKIO_WORKER_THREADS"] == "1"
    launched = group_environment(0, 2, "http://127.0.0.1:1", events_dir=None)
    for name, value in GROUP_THREADS.items():
        assert bench_env()[name] == value == launched[name], name


def test_the_ft_mode_runs_ft_strategy_s_defaults_and_ddp_as_ft_its_choice_for_each_model():
    """``ft`` is ``FTStrategy()`` as users run it: an explicit ``find_unused_parameters=True`` there (the default once)
    measured the search on the 0.3 M MLP, where the default now chooses none; ``ddp_as_ft`` follows the same choice."""
    from benchmarks.zoo.zoo_models import ZooModule
    from benchmarks.zoo.zoo_worker import FT_MODES, ft_ddp_settings

    assert FT_MODES["ft"] == {}
    assert ft_ddp_settings(ZooModule("mlp-0.3m"))["find_unused_parameters"] is False
    assert ft_ddp_settings(ZooModule("mlp-20m"))["find_unused_parameters"] is True

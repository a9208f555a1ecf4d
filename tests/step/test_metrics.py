"""Job-wide logging, metrics and callback decisions: every replica reports the same value, that value is the one a
single process computes over all the data, and EarlyStopping/ModelCheckpoint decide alike everywhere (real
processes: 2 replica groups of 2 processes each, real lighthouse)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from harness import WORKERS, LaunchedJob
from torchmetrics import MeanSquaredError, SpearmanCorrCoef

sys.path.insert(0, str(WORKERS))
from train_worker import Regressor, validation_dataset

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

GROUPS, NPROC = 2, 2
MAX_STEPS = 60
REPLICAS = [(group, rank) for group in range(GROUPS) for rank in range(NPROC)]


def metrics_by_replica(job: LaunchedJob, stage: str, fn: str) -> dict[tuple[int, int], list[dict]]:
    records = job.events("metrics", stage=stage, fn=fn)
    return {
        (group, rank): [(e["step"], e["values"]) for e in records if (e["group"], e["rank"]) == (group, rank)]
        for group, rank in REPLICAS
    }


def reference_metrics(model_state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The validation metrics of the final weights over the whole validation set, in this one process."""
    model = Regressor()
    model.load_state_dict(model_state)
    x, y = validation_dataset().tensors
    with torch.no_grad():
        prediction = model.net(x)
    batch_losses = [torch.nn.functional.mse_loss(prediction[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    return {
        "loss": torch.stack(batch_losses).mean().item(),
        "mse": MeanSquaredError()(prediction, y).item(),
        "spearman": SpearmanCorrCoef()(prediction.squeeze(-1), y.squeeze(-1)).item(),
    }


def test_logged_values_and_torchmetrics_are_job_wide_and_match_a_single_process_reference(launch):
    job = launch(
        groups=GROUPS,
        nproc_per_group=NPROC,
        worker_args=[
            f"--max-steps={MAX_STEPS}",
            "--val-every=10",
            "--sync-train-log",
            "--evaluate-after",
            "--monitor-dir={root}/best",
            "--gate-dir={root}",
        ],
    )
    job.wait_for("every worker's Manager to start", lambda: all(job.worker_pid(g, r) for g, r in REPLICAS), timeout=180)
    (job.root / "go").touch()
    assert job.wait_exit() == 0, job.tail()

    # self.log(sync_dist=True) inside training_step: the same value on every replica at every committed step.
    train = metrics_by_replica(job, "train", "fit")
    assert len(train[(0, 0)]) >= 20
    for replica in REPLICAS:
        assert train[replica] == train[(0, 0)], f"train metrics of {replica} differ from group 0 rank 0"
    assert all(values["train_loss_max"] >= values["train_loss_all"] for _, values in train[(0, 0)])

    # Validation inside fit: one record per validation, equal on every replica, bit for bit.
    fit_val = metrics_by_replica(job, "val", "fit")
    for replica in REPLICAS:
        assert fit_val[replica] == fit_val[(0, 0)], f"validation metrics of {replica} differ from group 0 rank 0"

    # EarlyStopping (mode="max", patience=0) stops every replica at the first validation whose loss did not rise,
    # and ModelCheckpoint (mode="min") agrees everywhere on the best score and file.
    losses = [(step, values["val_loss"]) for step, values in fit_val[(0, 0)]]
    stop_step = next(step for (_, before), (step, now) in itertools.pairwise(losses) if now <= before)
    assert [step for step, _ in losses] == list(range(10, stop_step + 1, 10))
    states = job.final_states()
    assert sorted(states) == REPLICAS
    for replica, state in states.items():
        assert state["global_step"] == stop_step < MAX_STEPS, replica
        assert state["best_model_score"].item() == min(loss for _, loss in losses), replica
        assert state["best_model_path"] == states[(0, 0)]["best_model_path"]
    assert Path(states[(0, 0)]["best_model_path"]).exists()

    # trainer.validate / trainer.test after fit: equal everywhere, and equal to a single-process reference.
    final = torch.load(job.out_dir / "final.group0.rank0.pt", weights_only=True)
    reference = reference_metrics(final["model"])
    for stage, fn in (("val", "validate"), ("test", "test")):
        records = metrics_by_replica(job, stage, fn)
        for replica in REPLICAS:
            assert records[replica] == records[(0, 0)], f"{stage} metrics of {replica} differ from group 0 rank 0"
        [(_, values)] = records[(0, 0)]
        for name, expected in reference.items():
            assert values[f"{stage}_{name}"] == pytest.approx(expected, rel=1e-5), f"{stage}_{name}"


def test_validate_and_test_with_a_dead_group_cover_the_live_groups_data_and_say_so(launch):
    """2 groups × 1 process; group 1 is SIGKILLed mid-fit and not restarted (``--max-restarts=0``). Group 0 trains on
    alone, then runs ``trainer.validate()`` and ``trainer.test()``: each says that 1 of the 2 groups takes part (a
    ``section_partial`` event and the warning), and its metrics are those of a single process over group 0's shard
    of the validation data (even indices: the sampler is the job's), not a hang and not a wrong denominator."""
    import os
    import signal

    from test_fault_tolerance import GATES, start_together

    max_steps = 30
    job = launch(groups=2, max_restarts=0, worker_args=[f"--max-steps={max_steps}", "--evaluate-after", *GATES])
    start_together(job, groups=2, nproc=1)
    job.wait_for(
        "both groups to commit 3 steps together",
        lambda: len([e for e in job.events("step", group=0, committed=True) if e["participants"] == 2]) >= 3,
    )
    os.kill(job.worker_pid(1, 0), signal.SIGKILL)
    assert job.wait_exit() != 0, "group 1 died for good: the launch reports it"
    states = job.final_states()
    assert sorted(states) == [(0, 0)] and states[(0, 0)]["global_step"] == max_steps, job.tail()
    partial = job.events("section_partial", group=0)
    # one per section: validate() and test() (each builds its own Manager, so `step` is that Manager's, 0)
    assert [(e["participants"], e["replica_groups"]) for e in partial] == [(1, 2)] * 2, partial
    assert "1 of 2 replica groups take part in this evaluation" in job.log_path.read_text(errors="replace")

    model = Regressor()
    model.load_state_dict(states[(0, 0)]["model"])
    x, y = validation_dataset().tensors
    x, y = x[0::2], y[0::2]  # group 0's shard: DistributedSampler(num_replicas=2, rank=0, shuffle=False)
    with torch.no_grad():
        prediction = model.net(x)
    batch_losses = [torch.nn.functional.mse_loss(prediction[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    expected = {
        "loss": torch.stack(batch_losses).mean().item(),
        "mse": MeanSquaredError()(prediction, y).item(),
        "spearman": SpearmanCorrCoef()(prediction.squeeze(-1), y.squeeze(-1)).item(),
    }
    for stage, fn in (("val", "validate"), ("test", "test")):
        [values] = [e["values"] for e in job.events("metrics", stage=stage, fn=fn, group=0)]
        for name, value in expected.items():
            assert values[f"{stage}_{name}"] == pytest.approx(value, rel=1e-5), f"{stage}_{name}"

"""Job-wide logging and metrics: every replica reports the same value, and that value is the one a single process
computes over all the data (real processes: 2 replica groups of 2 processes each, real lighthouse)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from harness import LaunchedJob
from torchmetrics import MeanSquaredError, SpearmanCorrCoef

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from train_worker import Regressor, validation_dataset

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

GROUPS, NPROC = 2, 2
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
        worker_args=["--max-steps=30", "--val-every=10", "--sync-train-log", "--evaluate-after", "--gate-dir={root}"],
    )
    job.wait_for("every worker's Manager to start", lambda: all(job.worker_pid(g, r) for g, r in REPLICAS), timeout=180)
    (job.root / "go").touch()
    assert job.wait_exit() == 0, job.tail()

    # self.log(sync_dist=True) inside training_step: the same value on every replica at every committed step.
    train = metrics_by_replica(job, "train", "fit")
    assert len(train[(0, 0)]) >= 30
    for replica in REPLICAS:
        assert train[replica] == train[(0, 0)], f"train metrics of {replica} differ from group 0 rank 0"
    assert all(values["train_loss_max"] >= values["train_loss_all"] for _, values in train[(0, 0)])

    # Validation inside fit: one record per validation, equal on every replica, bit for bit.
    fit_val = metrics_by_replica(job, "val", "fit")
    assert [step for step, _ in fit_val[(0, 0)]] == [10, 20, 30]
    for replica in REPLICAS:
        assert fit_val[replica] == fit_val[(0, 0)], f"validation metrics of {replica} differ from group 0 rank 0"

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

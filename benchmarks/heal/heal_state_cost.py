"""What building and restoring the heal's state costs: Lightning's checkpoint against the named pieces it replaced.

A heal used to carry named pieces of the training state (the module's state, each optimizer's and LR scheduler's, the
precision plugin's, the epoch progress, each callback's ``state_dict()``) and load them one by one. It now carries
Lightning's checkpoint (:func:`lightning_ft.heal.state.capture_training_state`: ``dump_checkpoint``, hooks included)
and restores it in Lightning's order (:func:`~lightning_ft.heal.state.apply_training_state`). Both move the same
tensors; what differs is the work around them. This measures, in one process and one run, both ways on one fitted
Trainer (an MLP of ``--params`` million float32 parameters with AdamW: three times that in state), interleaved
repetition by repetition:

* ``capture``: building the state on the sender (tensors shared, not copied);
* ``wire``: ``torch.save`` into memory and ``torch.load(weights_only=True)`` back, the transport's CPU work on both
  ends (the same bytes for both ways, give or take the keys);
* ``apply``: restoring it on the healer.

The verdict is the ratio of the checkpoint's median total (capture + wire + apply) to the pieces' in the same run.
Usage::

    python -m benchmarks.heal.heal_state_cost                 # 10 M parameters, 5 repetitions, a new results file
    python -m benchmarks.heal.heal_state_cost --params 25 --repeats 7
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.common.results import header, new_results_file
from lightning_ft.heal.state import apply_training_state, capture_training_state


class Wide(pl.LightningModule):
    def __init__(self, params_millions: float) -> None:
        super().__init__()
        width = int((params_millions * 1e6 / 2) ** 0.5)  # two square layers
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
        self.width = width

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fitted_trainer(params_millions: float) -> pl.Trainer:
    """A Trainer under FTStrategy (an in-process lighthouse, one group) after two committed steps."""
    module = Wide(params_millions)
    data = torch.utils.data.TensorDataset(torch.randn(8, module.width))
    trainer = pl.Trainer(
        strategy="ft",
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def capture_pieces(trainer: pl.Trainer) -> dict[str, Any]:
    """The heal's state as named pieces (before the heal was Lightning's checkpoint)."""
    return {
        "model": trainer.lightning_module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "epoch_progress": trainer.fit_loop.epoch_progress.state_dict(),
        "callbacks": {callback.state_key: callback.state_dict() for callback in trainer.callbacks},
    }


def apply_pieces(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    trainer.lightning_module.load_state_dict(state["model"], strict=True)
    for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_state)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler_state)
    trainer.precision_plugin.load_state_dict(state["precision"])
    trainer.fit_loop.epoch_progress.load_state_dict(state["epoch_progress"])
    for callback in trainer.callbacks:
        if callback.state_key in state["callbacks"]:
            callback.load_state_dict(state["callbacks"][callback.state_key])


WAYS: dict[str, tuple[Callable[[pl.Trainer], dict[str, Any]], Callable[[pl.Trainer, dict[str, Any]], None]]] = {
    "pieces": (capture_pieces, apply_pieces),
    "checkpoint": (lambda trainer: capture_training_state(trainer), apply_training_state),
}


def one_heal(trainer: pl.Trainer, way: str) -> dict[str, float]:
    capture, apply = WAYS[way]
    started = time.perf_counter()
    state = capture(trainer)
    captured = time.perf_counter()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    size = buffer.tell()
    buffer.seek(0)
    received = torch.load(buffer, weights_only=True)
    wired = time.perf_counter()
    apply(trainer, received)
    applied = time.perf_counter()
    return {
        "capture_s": captured - started,
        "wire_s": wired - captured,
        "apply_s": applied - wired,
        "total_s": applied - started,
        "bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=10.0, help="millions of model parameters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("LIGHTNING_FT_EVENTS_DIR", "")  # no event log for an in-process benchmark
    torch.set_num_threads(1)
    trainer = fitted_trainer(args.params)
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):  # interleaved, so both ways see the same machine
        for way in WAYS:
            runs[way].append(one_heal(trainer, way))
    medians = {way: {key: statistics.median(r[key] for r in reps) for key in reps[0]} for way, reps in runs.items()}
    ratio = medians["checkpoint"]["total_s"] / medians["pieces"]["total_s"]
    result = {
        **header(),
        "params_millions": args.params,
        "repeats": args.repeats,
        "medians": medians,
        "checkpoint_over_pieces_total": ratio,
        "runs": runs,
    }
    out = new_results_file("heal_state_cost", args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for way, median in medians.items():
        print(
            f"{way:>10}: capture {median['capture_s'] * 1e3:.1f} ms, wire {median['wire_s'] * 1e3:.0f} ms, "
            f"apply {median['apply_s'] * 1e3:.1f} ms, total {median['total_s'] * 1e3:.0f} ms, "
            f"{median['bytes'] / 1e6:.1f} MB"
        )
    print(f"checkpoint / pieces (total): {ratio:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

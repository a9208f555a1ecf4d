"""A LightningCLI training script that survives the death of any replica group.

Run one group on its own (an in-process lighthouse starts by itself):

    python examples/train.py fit --config examples/configs/ft.yaml

Run several groups on this machine, each a torchrun job that restarts and heals when it dies:

    lightning-ft launch --replica-groups 2 -- python examples/train.py fit --config examples/configs/ft.yaml

The only fault-tolerance line is in the YAML: ``strategy: class_path: lightning_ft.FTStrategy``.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanAbsoluteError


class RegressionModel(pl.LightningModule):
    """A small MLP regressor with AdamW and a step-interval cosine schedule."""

    def __init__(self, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, 1),
        )
        # Under FTStrategy a torchmetrics Metric (and sync_dist=True) covers every replica group's shard.
        self.val_mae = MeanAbsoluteError()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        prediction = self.net(x)
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.val_mae.update(prediction, y)
        self.log("val_mae", self.val_mae)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        total = max(self.trainer.max_steps, 1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SyntheticData(pl.LightningDataModule):
    """A fixed random regression task: y = sin(x · w), with x · w of standard deviation about 1.4, so that the MLP
    learns it within a few hundred steps (the loss falls from about 0.5 to under 0.01): the loss curve of a run, and of
    ``lightning-ft report``, shows training go on across a kill. Every group builds the same data and reads its own
    shard."""

    def __init__(self, size: int = 65536, batch_size: int = 32) -> None:
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.size, 32, generator=generator)
        w = torch.randn(32, 1, generator=generator) / 4
        self.data = TensorDataset(x, torch.sin(x @ w))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=256)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    LightningCLI(
        RegressionModel,
        SyntheticData,
        # Under torchrun, one Lightning process per torchrun worker.
        trainer_defaults={"devices": int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "accelerator": "cpu"},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()

"""The model and data every performance benchmark shares (``overhead.py``, ``goodput.py``, ``recovery.py``).

An MLP regression on synthetic data, sized by name: ``1m`` is the 1,050,112-parameter ``Linear(512, 1024) - ReLU -
Linear(1024, 512)`` of the torchft probes, ``50m`` stacks six ``Linear(1024, 4096) - ReLU - Linear(4096, 1024)``
blocks (50.4 M parameters). The data is a fixed pool of random inputs per rank with targets from a fixed random
linear map, so every run reads the same bytes and a step's cost is the model's, not the loader's.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class ModelSize:
    width: int
    hidden: int
    blocks: int
    batch_size: int
    batchnorm: bool = False  # a BatchNorm1d after every Linear: buffers that every forward pass changes

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(self.blocks):
            if self.batchnorm:
                layers += [nn.Linear(self.width, self.hidden), nn.BatchNorm1d(self.hidden), nn.ReLU()]
                layers += [nn.Linear(self.hidden, self.width), nn.BatchNorm1d(self.width)]
            else:
                layers += [nn.Linear(self.width, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.width)]
        return nn.Sequential(*layers)

    @property
    def parameters(self) -> int:
        return self.blocks * (2 * self.width * self.hidden + self.width + self.hidden)


SIZES = {
    "tiny": ModelSize(width=64, hidden=128, blocks=1, batch_size=16),  # cross-group costs dominate (scale.py)
    "1m": ModelSize(width=512, hidden=1024, blocks=1, batch_size=64),
    # buffers.py: 1.06 M parameters and 6,152 buffer elements in 24 buffers (a BatchNorm after every Linear)
    "1m_bn": ModelSize(width=256, hidden=512, blocks=4, batch_size=64, batchnorm=True),
    "50m": ModelSize(width=1024, hidden=4096, blocks=6, batch_size=32),
}


class SyntheticRegression(Dataset):
    """``length`` samples drawn from a pool of 32 batches: inputs ``x``, targets ``x @ W`` for a fixed ``W``."""

    def __init__(self, width: int, batch_size: int, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        pool = 32 * batch_size
        self.inputs = torch.randn(pool, width, generator=generator)
        mapping = torch.randn(width, width, generator=generator) / width**0.5
        self.targets = self.inputs @ mapping
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = index % self.inputs.shape[0]
        return self.inputs[row], self.targets[row]


class RegressionModule(pl.LightningModule):
    """The MLP under Lightning: MSE loss, AdamW (lr 1e-4), nothing logged (logging costs the same in every mode)."""

    def __init__(self, size: str) -> None:
        super().__init__()
        self.net = SIZES[size].build()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

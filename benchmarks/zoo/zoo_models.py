"""The step-time zoo of ``zoo.py`` (issue 25): an MLP, a small CNN and a small transformer, each at about 0.3 M, 1 M
and 20 M parameters, with batch sizes chosen so that a step takes 10 to 100 ms on one core of this machine (the 20 M
models take longer: their optimizer step and gradient exchange alone are tens of milliseconds).

Every model trains on a fixed pool of synthetic batches (the same bytes in every run and mode), so a step's cost is
the model's, not the loader's. ``ZooModule`` is what a Lightning user writes: AdamW, a learning-rate scheduler stepped
every optimizer step, and ``self.log`` of the loss every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class ZooModel:
    family: str  # "mlp", "cnn", "transformer"
    build: Callable[[], nn.Module]
    sample: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]  # (generator, count) -> batch
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int


def _mlp(width: int, hidden: int, blocks: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)]
        return nn.Sequential(*layers)

    return build


def _regression(width: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]:
    def sample(generator: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(count, width, generator=generator)
        return inputs, inputs.flip(1) * 0.5

    return sample


def _cnn(channels: int) -> Callable[[], nn.Module]:
    """Four 3x3 convolutions (channels c, 2c, 4c, 4c), each followed by ReLU, max-pooling between them, then a linear
    classifier over 10 classes: about 234 c^2 parameters."""

    def build() -> nn.Module:
        c = channels
        return nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4 * c, 4 * c, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * c, 10),
        )

    return build


def _images(side: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]:
    def sample(generator: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(count, 3, side, side, generator=generator)
        return images, torch.randint(0, 10, (count,), generator=generator)

    return sample


class _TinyTransformer(nn.Module):
    """A token embedding, ``layers`` pre-norm encoder layers and a head over the vocabulary (next-token loss)."""

    VOCAB = 256

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, self.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def _tokens(length: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]:
    def sample(generator: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, _TinyTransformer.VOCAB, (count, length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    return sample


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets.flatten())


ZOO: dict[str, ZooModel] = {
    "mlp-0.3m": ZooModel("mlp", _mlp(256, 512, 1), _regression(256), nn.functional.mse_loss, 384),
    "mlp-1m": ZooModel("mlp", _mlp(512, 1024, 1), _regression(512), nn.functional.mse_loss, 256),
    "mlp-20m": ZooModel("mlp", _mlp(1024, 5120, 2), _regression(1024), nn.functional.mse_loss, 16),
    "cnn-0.3m": ZooModel("cnn", _cnn(36), _images(32), _cross_entropy, 16),
    "cnn-1m": ZooModel("cnn", _cnn(65), _images(32), _cross_entropy, 8),
    "cnn-20m": ZooModel("cnn", _cnn(292), _images(8), _cross_entropy, 2),
    "transformer-0.3m": ZooModel("transformer", lambda: _TinyTransformer(128, 1), _tokens(64), _cross_entropy, 16),
    "transformer-1m": ZooModel("transformer", lambda: _TinyTransformer(128, 5), _tokens(64), _cross_entropy, 4),
    "transformer-20m": ZooModel("transformer", lambda: _TinyTransformer(512, 6), _tokens(32), _cross_entropy, 2),
}


class ZooBatches(Dataset):
    """``length`` samples drawn from a pool of 16 batches of the model's synthetic data."""

    def __init__(self, model: ZooModel, length: int, seed: int = 0) -> None:
        self.inputs, self.targets = model.sample(torch.Generator().manual_seed(seed), 16 * model.batch_size)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = index % self.inputs.shape[0]
        return self.inputs[row], self.targets[row]


class ZooModule(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spec = ZOO[name]
        self.net = self.spec.build()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.spec.loss(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 1e-3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def parameter_count(name: str) -> int:
    return sum(p.numel() for p in ZOO[name].build().parameters())

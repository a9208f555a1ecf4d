"""DiLoCo with one replica group against a hand-written reference of the DiLoCo update on the same data."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer as make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import FTStrategy

INNER_LR = 0.05


@pytest.fixture(autouse=True)
def _single_group(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=INNER_LR)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def reference(
    model: Net,
    steps: int,
    sync_every: int,
    fragments: list[list[str]],
    outer_lr: float,
    delay: int = 0,
    alpha: float = 0,
) -> Net:
    """Streaming DiLoCo written out: inner SGD on every batch; fragment (sync count % k) syncs every sync_every/k inner
    steps. Its pseudo-gradient (global - local) is taken ``delay`` inner steps before the sync; at the sync, the
    fragment's parameters are reset to the global ones, one Nesterov outer step applies the pseudo-gradient, the
    result becomes the new global parameters, and the local parameters (``delay`` steps further on) are mixed back in
    by ``alpha``. The final sync syncs every fragment with alpha 0."""
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    outers = [
        torch.optim.SGD([params[n] for n in names], lr=outer_lr, momentum=0.9, nesterov=True) for names in fragments
    ]
    global_params = {n: p.detach().clone() for n, p in params.items()}
    period = sync_every // len(fragments)
    syncs = 1  # the join sync at the start counts as the Manager's first step
    pending: dict[str, torch.Tensor] | None = None

    def prepare() -> None:
        nonlocal pending
        pending = {name: global_params[name] - params[name].detach() for name in fragments[syncs % len(fragments)]}

    def perform(mix: float) -> None:
        nonlocal syncs, pending
        assert pending is not None
        index = syncs % len(fragments)
        with torch.no_grad():
            local = {name: params[name].detach().clone() for name in fragments[index]}
            for name in fragments[index]:
                params[name].copy_(global_params[name])
                params[name].grad = pending[name]
        outers[index].step()
        outers[index].zero_grad()
        with torch.no_grad():
            for name in fragments[index]:
                global_params[name] = params[name].detach().clone()
                params[name].lerp_(local[name], mix)
        syncs += 1
        pending = None

    batches = list(DataLoader(data(), batch_size=4))
    for step in range(steps):
        if step and (step + delay) % period == 0:
            prepare()
        if step and step % period == 0:
            perform(alpha)
        x, y = batches[step]
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
    remaining = len(fragments)
    if pending is not None:
        perform(0.0)
        remaining -= 1
    for _ in range(remaining):  # the final sync: every fragment
        prepare()
        perform(0.0)
    return model


@pytest.mark.parametrize(
    ("fragments", "names", "delay", "alpha"),
    [
        (None, [["body.weight", "body.bias", "head.weight", "head.bias"]], 0, 0.0),
        ([["body"], ["head"]], [["body.weight", "body.bias"], ["head.weight", "head.bias"]], 0, 0.0),
        ([["body"], ["head"]], [["body.weight", "body.bias"], ["head.weight", "head.bias"]], 1, 0.0),
        ([["body"], ["head"]], [["body.weight", "body.bias"], ["head.weight", "head.bias"]], 1, 0.5),
        (None, [["body.weight", "body.bias", "head.weight", "head.bias"]], 3, 0.25),
    ],
    ids=["diloco", "streaming-2-fragments", "streaming-delay-1", "streaming-delay-1-alpha-0.5", "delay-3-alpha-0.25"],
)
def test_one_group_matches_a_hand_written_diloco(tmp_path, fragments, names, delay, alpha):
    steps, sync_every, outer_lr = 12, 4, 0.7
    model = Net()
    expected = reference(model, steps, sync_every, names, outer_lr, delay, alpha)
    strategy = FTStrategy(
        algorithm="diloco",
        sync_every=sync_every,
        fragments=fragments,
        fragment_sync_delay=delay,
        fragment_update_alpha=alpha,
        outer_optimizer={
            "class_path": "torch.optim.SGD",
            "init_args": {"lr": outer_lr, "momentum": 0.9, "nesterov": True},
        },
        timeout=20,
        quorum_timeout=20,
    )
    trainer = make_trainer(
        strategy,
        max_steps=steps,
        limit_val_batches=0,
        use_distributed_sampler=False,  # the reference reads the batches in order
        default_root_dir=tmp_path,
    )
    steps_seen: list[int] = []

    class Final(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            steps_seen.append(trainer.strategy.manager.current_step())

    trainer.callbacks.append(Final())
    trainer.fit(model, DataLoader(data(), batch_size=4))
    k = len(names)
    assert trainer.global_step == steps
    assert steps_seen == [1 + steps // (sync_every // k) + (k - 1)]  # join, periodic syncs, rest of the final sync
    for (name, got), (_, want) in zip(model.named_parameters(), expected.named_parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} differs from the reference")


def fit_diloco(tmp_path, model: Net, max_steps: int, ckpt_path=None, callbacks=(), delay: int = 0) -> pl.Trainer:
    strategy = FTStrategy(
        algorithm="diloco", sync_every=4, fragments=2, fragment_sync_delay=delay, timeout=20, quorum_timeout=20
    )
    trainer = make_trainer(
        strategy,
        list(callbacks),
        max_steps=max_steps,
        enable_checkpointing=bool(callbacks),
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(data(), batch_size=4), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    ("checkpoint_step", "delay"),
    [(6, 0), (5, 0), (5, 1)],
    ids=["at-a-sync-step", "between-syncs", "at-a-delayed-sync-opening"],
)
def test_resume_restores_global_parameters_and_outer_optimizer(tmp_path, checkpoint_step, delay):
    """A checkpoint holds DiLoCo's global parameters and outer optimizer state: resuming from it ends bit-identical to
    a run that was never interrupted. Taken at a sync step, the resumed run starts with that sync; taken between two
    syncs, it starts with no sync at all (every group resumes at the same step, nobody heals); taken where a delayed
    sync opens, it starts with that sync's first half."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight = Net()
    fit_diloco(tmp_path / "straight", straight, max_steps=12, delay=delay)

    first = Net()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=checkpoint_step, save_top_k=-1)
    fit_diloco(tmp_path / "first", first, max_steps=checkpoint_step, callbacks=[checkpoint], delay=delay)
    path = tmp_path / "ckpt" / f"epoch=0-step={checkpoint_step}.ckpt"
    saved = torch.load(path, weights_only=False)
    assert len(saved["lightning_ft_diloco"]["outer_optimizers"]) == 2

    resumed = Net()
    fit_diloco(
        tmp_path / "resumed",
        resumed,
        max_steps=12,
        ckpt_path=path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")],
        delay=delay,
    )
    for (name, got), (_, want) in zip(resumed.named_parameters(), straight.named_parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} differs after resume")

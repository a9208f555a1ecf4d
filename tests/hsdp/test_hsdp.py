"""HSDP (``data_parallel="fsdp"``) on one real replica group in this process: settings, sharding, the cross-group
hook, the heal payload of sharded state, and checkpoints of sharded state (real Manager, in-process lighthouse, gloo,
FSDP2 over a one-process mesh). The multi-process behaviour is in ``test_hsdp_recovery.py``."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import assert_tree_equal, example_cli, loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_ft import FTConfigError, FTStrategy
from lightning_ft.heal.state import (
    IncompatibleReplicaError,
    apply_training_state,
    capture_training_state,
    state_fingerprint,
)
from lightning_ft.hsdp.shards import SHARD_KEY

pytestmark = pytest.mark.timeout(180)


class Blocks(pl.LightningModule):
    """Two blocks and a head; ``shard_self`` makes configure_model shard it itself, over ``self.device_mesh``."""

    def __init__(self, shard_self: bool = False, partial: bool = False) -> None:
        super().__init__()
        self.shard_self, self.partial = shard_self, partial
        self.blocks = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
        )
        self.head = torch.nn.Linear(16, 1)

    def configure_model(self) -> None:
        if not self.shard_self or isinstance(self.blocks[0], FSDPModule):
            return
        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh)
        if not self.partial:  # partial: the head is left out, FTStrategy must cover it
            fully_shard(self, mesh=self.device_mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fsdp(**kwargs: Any) -> FTStrategy:
    return FTStrategy(data_parallel="fsdp", **kwargs)


def sharded_modules(module: torch.nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if isinstance(child, FSDPModule)]


# ---------------------------------------------------------------------------------------------------- settings
def test_fsdp_defaults_to_synchronous_quorum_and_ddp_stays_the_default():
    assert FTStrategy().data_parallel.data_parallel == "ddp"
    assert FTStrategy().settings.use_async_quorum is True
    strategy = fsdp()
    assert strategy.data_parallel.sharded and strategy.settings.use_async_quorum is False


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"data_parallel": "zero3"}, r"data_parallel='zero3'.*'ddp'.*'fsdp'"),
        ({"fsdp_wrap": ["Linear"]}, r"fsdp_wrap only applies to data_parallel='fsdp'"),
        ({"fsdp_cpu_offload": True, "fsdp_min_params": 10}, r"fsdp_min_params, fsdp_cpu_offload only apply"),
        ({"data_parallel": "fsdp", "algorithm": "diloco", "sync_every": 4}, r"data_parallel='fsdp'.*'diloco'"),
        ({"data_parallel": "fsdp", "algorithm": "local_sgd", "sync_every": 4}, r"data_parallel='fsdp'.*'local_sgd'"),
        ({"data_parallel": "fsdp", "use_async_quorum": True}, r"use_async_quorum=True.*data_parallel='fsdp'"),
        ({"data_parallel": "fsdp", "bucket_cap_mb": 10}, r"bucket_cap_mb.*DistributedDataParallel"),
        ({"data_parallel": "fsdp", "static_graph": True}, r"static_graph.*do not apply"),
        ({"data_parallel": "fsdp", "fsdp_min_params": 0}, r"fsdp_min_params=0"),
        ({"data_parallel": "fsdp", "fsdp_mixed_precision": {"param_dtype": "bf17"}}, r"param_dtype='bf17'"),
        ({"data_parallel": "fsdp", "fsdp_mixed_precision": {"dtype": "bfloat16"}}, r"unknown key.*'dtype'"),
        ({"data_parallel": "fsdp", "fsdp_mixed_precision": "bf16"}, r"fsdp_mixed_precision='bf16'.*mapping"),
        ({"data_parallel": "fsdp", "fsdp_reshard_after_forward": 2}, r"fsdp_reshard_after_forward=2"),
        ({"data_parallel": "fsdp", "fsdp_wrap": [""]}, r"fsdp_wrap"),
    ],
)
def test_bad_fsdp_settings_are_refused_naming_the_setting(kwargs, names):
    with pytest.raises(FTConfigError, match=names):
        FTStrategy(**kwargs)


def test_mixed_precision_from_names():
    policy = fsdp(fsdp_mixed_precision={"param_dtype": "bf16", "reduce_dtype": "torch.float32"}).data_parallel.fsdp
    assert policy is not None
    assert policy.mixed_precision.param_dtype is torch.bfloat16
    assert policy.mixed_precision.reduce_dtype is torch.float32


def test_example_config_parses_into_the_strategy(monkeypatch):
    cli = example_cli(monkeypatch, "hsdp.yaml")
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FTStrategy) and strategy.data_parallel.sharded
    assert strategy.settings.use_async_quorum is False
    settings = strategy.data_parallel.fsdp
    assert settings is not None and settings.wrap_classes == ("Linear",)
    assert settings.mixed_precision.reduce_dtype is torch.float32


# ---------------------------------------------------------------------------------------------------- sharding
def test_auto_wrap_by_class_shards_listed_modules_and_the_root():
    run = trainer(fsdp(fsdp_wrap=["torch.nn.Linear"]), max_steps=2)
    model = Blocks()
    run.fit(model, loader())
    assert sharded_modules(model) == ["", "blocks.0.0", "blocks.1.0", "head"]
    assert all(isinstance(param, DTensor) for param in model.parameters())
    assert run.global_step == 2


def test_a_second_fit_keeps_the_auto_wrapped_layout():
    model = Blocks()
    for max_steps in (1, 2):
        run = trainer(fsdp(fsdp_wrap=["Linear"]), max_steps=max_steps)
        run.fit(model, loader())
    assert sharded_modules(model) == ["", "blocks.0.0", "blocks.1.0", "head"]


def test_auto_wrap_by_size_counts_parameters_not_already_wrapped():
    run = trainer(fsdp(fsdp_min_params=200), max_steps=1)
    model = Blocks()
    run.fit(model, loader())
    # blocks.1.0 (272 parameters) and its Sequential are one; blocks.0 (144) stays with the root.
    assert sharded_modules(model) == ["", "blocks.1.0"]


def test_fsdp_wrap_that_matches_nothing_is_refused_naming_the_classes_present():
    run = trainer(fsdp(fsdp_wrap=["TransformerBlock"]), max_steps=1)
    with pytest.raises(FTConfigError, match=r"'TransformerBlock' matches no module.*Linear"):
        run.fit(Blocks(), loader())


def test_configure_model_layout_is_kept_and_completed():
    run = trainer(fsdp(), max_steps=2)
    model = Blocks(shard_self=True, partial=True)
    run.fit(model, loader())
    # configure_model sharded the two blocks; the head was left out, so the LightningModule covers it.
    assert sharded_modules(model) == ["", "blocks.0", "blocks.1"]
    assert run.global_step == 2


def test_sharding_options_with_a_configure_model_layout_are_refused():
    run = trainer(fsdp(fsdp_wrap=["Linear"]), max_steps=1)
    with pytest.raises(FTConfigError, match=r"fsdp_wrap: configure_model\(\) already applied fully_shard"):
        run.fit(Blocks(shard_self=True), loader())


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_shards():
    seen: list[torch.dtype] = []

    class RecordDtype(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            pl_module.head.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))

    strategy = fsdp(fsdp_wrap=["Linear"], fsdp_mixed_precision={"param_dtype": "bfloat16"}, fsdp_cpu_offload=True)
    run = trainer(strategy, callbacks=[RecordDtype()], max_steps=1)
    model = Blocks()
    run.fit(model, loader())
    assert seen and seen[0] is torch.bfloat16
    assert all(param.dtype is torch.float32 for param in model.parameters())


# ---------------------------------------------------------------------------------------------------- the hook
class FailingWork:
    """The cross-group allreduce of a peer that died mid-collective (gloo: "Connection reset by peer")."""

    def wait(self, *args: Any) -> bool:
        raise RuntimeError("injected: Connection reset by peer")


class FailOneAllreduce(pl.Callback):
    """Makes the cross-group allreduce inside FSDP2's hook fail during batch ``index``; snapshots the state."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.failed = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.index:
            return
        self.before = {"fingerprint": state_fingerprint(trainer), "step": trainer.global_step}
        pg = trainer.strategy.manager._pg
        allreduce = pg.allreduce

        def fail_once(*args: Any, **kwargs: Any) -> Any:
            pg.allreduce = allreduce
            self.failed += 1
            return FailingWork()

        pg.allreduce = fail_once

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.index:
            self.after = {"fingerprint": state_fingerprint(trainer), "step": trainer.global_step}


def test_a_cross_group_failure_inside_backward_leaves_the_step_uncommitted():
    failure = FailOneAllreduce(index=2)
    run = trainer(fsdp(fsdp_wrap=["Linear"]), callbacks=[failure], max_steps=5)
    run.fit(Blocks(), loader())
    assert failure.failed == 1
    assert failure.after == failure.before, "an uncommitted step changed the sharded state"
    assert run.global_step == 5  # the job carried on and committed the remaining steps


# ---------------------------------------------------------------------------------------------------- heal payload
@pytest.fixture(scope="module")
def fitted() -> pl.Trainer:
    run = trainer(fsdp(fsdp_wrap=["Linear"]), max_steps=2)
    run.fit(Blocks(), loader())
    return run


def test_heal_payload_carries_local_shards_not_dtensors(fitted):
    state = capture_training_state(fitted)

    def leaves(tree: Any) -> list[Any]:
        if isinstance(tree, dict) and SHARD_KEY not in tree:
            return [leaf for value in tree.values() for leaf in leaves(value)]
        if isinstance(tree, (list, tuple)):
            return [leaf for value in tree for leaf in leaves(value)]
        return [tree]

    found = leaves(state["state_dict"]) + leaves(state["optimizer_states"])
    assert not any(isinstance(leaf, DTensor) for leaf in found)
    shard = state["state_dict"]["head.weight"]
    assert shard[SHARD_KEY].shape == (1, 16) and shard["global_shape"] == [1, 16]


def test_heal_round_trip_keeps_the_full_state_bit_identical(fitted):
    before = state_fingerprint(fitted)
    state = capture_training_state(fitted)
    # What the receiver gets: copies, as a transport delivers them.
    received = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    with torch.no_grad():
        for param in fitted.lightning_module.parameters():
            param.to_local().zero_()
    assert state_fingerprint(fitted) != before
    apply_training_state(fitted, received)
    assert state_fingerprint(fitted) == before
    assert all(isinstance(param, DTensor) for param in fitted.lightning_module.parameters())


def test_a_shard_of_another_size_is_refused(fitted):
    state = capture_training_state(fitted)
    shard = dict(state["state_dict"]["blocks.0.0.weight"])
    shard[SHARD_KEY] = shard[SHARD_KEY][:8]  # what a rank of a group with two processes holds
    state["state_dict"] = {**state["state_dict"], "blocks.0.0.weight": shard}
    with pytest.raises(IncompatibleReplicaError, match="same number of processes"):
        apply_training_state(fitted, state)


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_holds_the_full_state_and_resumes_sharded(tmp_path):
    first = trainer(
        fsdp(fsdp_wrap=["Linear"]),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True)],
        enable_checkpointing=True,
        max_steps=3,
    )
    first.fit(Blocks(), loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    # A plain, unsharded Lightning checkpoint: the model loads into an unsharded module as it is.
    assert all(type(tensor) is torch.Tensor for tensor in saved["state_dict"].values())
    Blocks().load_state_dict(saved["state_dict"])
    assert set(saved["optimizer_states"][0]["state"]) == set(saved["state_dict"])  # keyed by parameter name
    reference = {
        "model": saved["state_dict"],
        "optimizer": saved["optimizer_states"][0]["state"],
    }

    restored: dict[str, Any] = {}

    class Restored(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # Copies: on a one-process mesh the full tensors are the live ones, which the next step changes.
            model = {name: tensor.full_tensor() for name, tensor in pl_module.state_dict().items()}
            optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])["state"]
            restored.update(copy.deepcopy({"model": model, "optimizer": optimizer}))
            restored["step"] = trainer.strategy.manager.current_step()

    resumed = trainer(fsdp(fsdp_wrap=["Linear"]), callbacks=[Restored()], max_steps=4)
    resumed.fit(Blocks(), loader(), ckpt_path=tmp_path / "last.ckpt")
    assert restored.pop("step") == 3 and resumed.global_step == 4
    assert_tree_equal(reference, restored)


# ---------------------------------------------------------------------------------------------------- numerics
class CallsForward(Blocks):
    """Goes through ``self(x)`` (a forward nested in the registered training_step), logs, validates."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)


@pytest.mark.parametrize("manual", [False, True])
def test_fsdp_group_trains_like_a_ddp_group_with_accumulation_and_clipping(manual):
    """One group of one process: the same steps with FSDP2 (accumulation through set_requires_gradient_sync,
    clipping over DTensor gradients, nested forward) as with DDP; validation and test run on the sharded model."""

    class Manual(CallsForward):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5)
            optimizer.step()
            return loss

    def fit(strategy: FTStrategy) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        model = Manual() if manual else CallsForward()
        options: dict[str, Any] = {} if manual else {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
        run = trainer(strategy, max_steps=4, limit_val_batches=2, val_check_interval=4, **options)
        run.fit(model, loader(), loader(n=32))
        run.validate(model, loader(n=32), verbose=False)
        run.test(model, loader(n=32), verbose=False)
        return {name: getattr(t, "full_tensor", lambda t=t: t)() for name, t in model.state_dict().items()}

    ddp = fit(FTStrategy())
    sharded = fit(fsdp(fsdp_wrap=["Linear"]))
    for name, tensor in ddp.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

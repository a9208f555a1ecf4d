"""Step semantics under FTStrategy, on one real replica group (real Manager, in-process lighthouse, gloo).

A step that does not commit is produced the way it happens in production: an error is reported to the Manager
before the vote (as a failed cross-group allreduce does), so ``should_commit()`` itself says no.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, assert_tree_equal, loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import FTStrategy, loop_patches
from lightning_ft.callbacks import QuorumCallback
from lightning_ft.manager import FTManager

pytestmark = pytest.mark.timeout(120)


class CountCalls(pl.Callback):
    """Counts the Manager's quorum and commit calls (the real methods still run)."""

    def __init__(self) -> None:
        self.quorums = 0
        self.votes = 0
        self.step_pairs: list[tuple[int, int]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        manager = trainer.strategy.manager
        start_quorum, should_commit = manager.start_quorum, manager.should_commit

        def counted_quorum(*args: Any, **kwargs: Any) -> None:
            self.quorums += 1
            start_quorum(*args, **kwargs)

        def counted_vote(*args: Any, **kwargs: Any) -> bool:
            self.votes += 1
            return should_commit(*args, **kwargs)

        manager.start_quorum, manager.should_commit = counted_quorum, counted_vote

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step_pairs.append((trainer.global_step, trainer.strategy.manager.current_step()))


def test_registered_as_ft_strategy():
    assert isinstance(trainer("ft").strategy, FTStrategy)


def test_sampler_shards_over_groups_by_group_id_then_rank():
    strategy = FTStrategy(replica_group_id=2, num_replica_groups=3, lighthouse="http://localhost:1")
    trainer(strategy)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 2}


@pytest.mark.parametrize("accumulate", [1, 3])
def test_global_step_is_the_committed_step_with_one_quorum_and_one_vote_per_optimizer_step(accumulate):
    counter = CountCalls()
    run = trainer(callbacks=[counter], max_steps=6, accumulate_grad_batches=accumulate)
    run.fit(Regressor(), loader())
    assert run.global_step == 6
    assert counter.quorums == 6 and counter.votes == 6
    assert counter.step_pairs and all(global_step == committed for global_step, committed in counter.step_pairs)


class RejectOneStep(pl.Callback):
    """Reports an error to the Manager before the vote of batch ``index``; records state around that batch."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    @staticmethod
    def snapshot(trainer: pl.Trainer) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "params": trainer.lightning_module.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
                "lr": [group["lr"] for group in trainer.optimizers[0].param_groups],
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step,
            }
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.index:
            self.before = self.snapshot(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.index:
            trainer.strategy.manager.report_error(RuntimeError("injected: cross-group allreduce failed"))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.index:
            self.after = self.snapshot(trainer)


@pytest.mark.parametrize("own_quorum_callback", [False, True], ids=["default-callbacks", "quorum-callback-last"])
def test_uncommitted_step_changes_nothing_learning_rate_included(own_quorum_callback):
    """With the user's own ``QuorumCallback`` last in the list, the other callbacks' batch-end hooks run before it:
    the step is still closed and ``global_step`` on the committed count there (the step owner ends it first)."""
    reject = RejectOneStep(index=3)
    counter = CountCalls()
    callbacks = [reject, counter, QuorumCallback()] if own_quorum_callback else [reject, counter]
    run = trainer(callbacks=callbacks, max_steps=6)
    run.fit(Regressor(), loader())
    assert counter.step_pairs and all(global_step == committed for global_step, committed in counter.step_pairs)

    assert reject.before and reject.after
    assert reject.after["global_step"] == reject.before["global_step"] == 3
    assert reject.after["lr"] == reject.before["lr"]
    assert reject.after["scheduler"] == reject.before["scheduler"]
    for name, tensor in reject.before["params"].items():
        assert torch.equal(tensor, reject.after["params"][name]), name
    assert_tree_equal(reject.before["optimizer"], reject.after["optimizer"])
    # the rejected batch is not counted: 6 committed steps took 7 batches
    assert run.global_step == 6
    assert run.fit_loop.epoch_loop.batch_progress.total.completed == 7
    assert run.lr_scheduler_configs[0].scheduler.last_epoch == 6


def test_accumulation_and_clipping_match_a_single_process_reference():
    def train(strategy: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        model = Regressor()
        # Lightning always shuffles under a distributed sampler; both runs read the same sequential batches here.
        run = trainer(
            strategy, max_steps=5, accumulate_grad_batches=2, gradient_clip_val=0.3, use_distributed_sampler=False
        )
        run.fit(model, loader())
        assert run.global_step == 5
        return model.state_dict()

    reference = train("auto")
    fault_tolerant = train(FTStrategy())
    for name, tensor in reference.items():
        assert torch.equal(tensor, fault_tolerant[name]), f"{name} differs from the single-process reference"


class TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        for optimizer, layer in zip(self.optimizers(), (self.a, self.b), strict=True):
            optimizer.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(layer(x), y))
            optimizer.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]


def test_manual_optimization_takes_one_commit_decision_per_batch_for_every_optimizer():
    counter = CountCalls()
    model = TwoOptimizers()
    initial = copy.deepcopy(model.state_dict())
    run = trainer(callbacks=[counter], max_steps=4)
    run.fit(model, loader())
    assert counter.quorums == 4 and counter.votes == 4
    assert run.global_step == 4
    for name, tensor in model.state_dict().items():
        assert not torch.equal(tensor, initial[name]), f"{name} was never stepped"


class OverflowOnce(pl.Callback):
    """Puts an inf into one gradient of batch ``index`` after backward, so the GradScaler skips that step."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.index:
            next(pl_module.parameters()).grad.fill_(float("inf"))


def test_gradscaler_skipped_step_still_takes_exactly_one_vote_and_scaler_state_travels():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_ft.heal.state import apply_training_state, capture_training_state

    counter = CountCalls()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    run = trainer(plugins=[plugin], callbacks=[counter, OverflowOnce(index=2)], max_steps=5)
    run.fit(Regressor(), loader())
    assert counter.quorums == 5 and counter.votes == 5
    assert run.global_step == 5
    assert plugin.scaler.get_scale() < 65536.0  # the overflow backed the scale off
    sent = capture_training_state(run)
    assert sent["MixedPrecision"]["scale"] == plugin.scaler.get_scale()

    # A healing replica loads it: its own scaler, in another state, takes the sender's scale and growth tracker.
    healer_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    healer = trainer(plugins=[healer_plugin], max_steps=1)
    healer.fit(Regressor(), loader())
    assert healer_plugin.scaler.state_dict() != plugin.scaler.state_dict()
    apply_training_state(healer, sent)
    assert healer_plugin.scaler.state_dict() == plugin.scaler.state_dict()


class WithValidation(Regressor):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)


def validation_loss(model: Regressor, data: torch.utils.data.DataLoader) -> float:
    """What ``WithValidation`` logs for ``data``, computed here: the mean of its batches' losses (equal batches)."""
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model.net(x), y) for x, y in data]
    return torch.stack(losses).mean().item()


def test_validate_and_test_outside_fit_get_a_manager_of_their_own_and_shut_it_down():
    class SeesManager(pl.Callback):
        managers: list[object] = []

        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.managers.append(trainer.strategy.manager)

    strategy = FTStrategy()
    seen = SeesManager()
    run = trainer(strategy, callbacks=[seen])
    model = WithValidation()
    [metrics] = run.validate(model, loader(n=64))
    assert metrics["val_loss"] == pytest.approx(validation_loss(model, loader(n=64)), rel=1e-6)
    assert len(seen.managers) == 1  # combined across groups through a Manager...
    assert strategy._fit is None  # ...that teardown shut down
    assert strategy.is_checkpoint_writer  # outside fit, group 0 rank 0 writes


def test_model_checkpoint_names_do_not_depend_on_what_other_groups_already_wrote(tmp_path):
    """With Lightning's version counter, a group that looks after the writer wrote ``step=N.ckpt`` would call its
    own copy ``step=N-v1.ckpt``: its ModelCheckpoint state would name files that are never written. Jobs of several
    groups turn the counter off for the fit (and back on after it); a job of one group keeps Lightning's names."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    patches = loop_patches.LoopPatches()
    loop_patches.name_checkpoints_alike(patches, SimpleNamespace(checkpoint_callbacks=[checkpoint]))  # type: ignore[arg-type]
    assert checkpoint._enable_version_counter is False
    patches.undo()
    assert checkpoint._enable_version_counter is True  # the user's setting again once the fit is over

    run = trainer(callbacks=[checkpoint], max_steps=2, enable_checkpointing=True)
    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"an earlier run's")
    run.fit(Regressor(), loader())
    assert Path(checkpoint.best_model_path).name == "epoch=0-step=2-v1.ckpt"  # one group: Lightning's own names


def test_validation_inside_fit_runs_and_keeps_committed_step_semantics():
    run = trainer(max_steps=6, val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=2)
    model = WithValidation()
    run.fit(model, loader(), loader(n=64))
    assert run.global_step == 6
    # The last validation ran after step 6: with the final weights, on the first 2 batches.
    assert run.callback_metrics["val_loss"].item() == pytest.approx(validation_loss(model, loader(n=16)), rel=1e-6)


def test_validation_inside_fit_combines_on_the_last_steps_quorum_without_asking_the_lighthouse(monkeypatch):
    """A sync section uses the quorum the groups are in: every quorum this fit asks for is a training step's
    (``allow_heal=True``), none a section's, though every validation combines ``val_loss`` across groups."""
    asked: list[dict[str, object]] = []
    start_quorum = FTManager.start_quorum

    def recording(self: FTManager, **kwargs: Any) -> None:
        asked.append(kwargs)
        start_quorum(self, **kwargs)

    monkeypatch.setattr(FTManager, "start_quorum", recording)
    run = trainer(max_steps=6, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=2)
    run.fit(WithValidation(), loader(), loader(n=64))
    assert run.global_step == 6 and "val_loss" in run.callback_metrics
    assert len(asked) == 6
    assert all(request.get("allow_heal", True) for request in asked), asked


class BatchNormRegressor(Regressor):
    """A model with buffers: BatchNorm's running statistics change in every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )


def test_uncommitted_step_changes_no_buffer():
    """The rejected step's forward pass moved the running statistics; the step ends with them where they were."""
    reject = RejectOneStep(index=3)
    run = trainer(callbacks=[reject], max_steps=6)
    run.fit(BatchNormRegressor(), loader())
    for name in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(reject.before["params"][name], reject.after["params"][name]), name
    assert int(run.lightning_module.net[1].num_batches_tracked) == 6, "one forward pass per committed step"


class CaptureHealPayload(pl.Callback):
    """At batch 2, after the forward pass (the running statistics have moved), take the state that the Manager
    would send to a healing peer right now, and the model's buffers as they were at the batch start."""

    def __init__(self) -> None:
        self.at_batch_start: dict[str, torch.Tensor] = {}
        self.sent: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self.at_batch_start = {name: b.clone() for name, b in pl_module.named_buffers()}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == 2:
            payload = trainer.strategy.manager._manager_state_dict()  # what torchft's send_checkpoint serves
            self.sent = {name: payload["user"]["lightning"]["state_dict"][name].clone() for name in self.at_batch_start}


def test_a_healing_peer_is_sent_the_committed_buffers_not_those_the_forward_pass_is_changing():
    capture = CaptureHealPayload()
    run = trainer(callbacks=[capture], max_steps=4)
    run.fit(BatchNormRegressor(), loader())
    assert capture.sent, "the payload was not taken"
    for name, before in capture.at_batch_start.items():
        assert torch.equal(capture.sent[name], before), name


def test_an_optimizer_that_evaluates_the_closure_itself_is_refused_at_fit_naming_it():
    from lightning_ft import FTConfigError

    class LineSearch(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    with pytest.raises(FTConfigError, match="optimizer 0 is LBFGS, whose step\\(\\) evaluates the closure"):
        trainer(max_steps=2).fit(LineSearch(), loader())


def test_training_step_with_dataloader_iter_commits_every_step():
    class IteratorStep(Regressor):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
            (x, y), _, _ = next(dataloader_iter)
            return torch.nn.functional.mse_loss(self.net(x), y)

    counter = CountCalls()
    run = trainer(callbacks=[counter], max_steps=5, accumulate_grad_batches=2)
    run.fit(IteratorStep(), loader())
    assert run.global_step == 5 and counter.votes == 5
    assert all(global_step == committed for global_step, committed in counter.step_pairs)

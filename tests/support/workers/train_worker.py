"""A training script for the multi-process tests: one replica-group process under FTStrategy.

Started by ``lightning-ft launch`` (so under torchrun). Each group seeds its model differently, so bit-identical
replicas at the end prove that healing and ``init_sync`` did their job rather than equal seeds.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset
from torchmetrics import MeanSquaredError, SpearmanCorrCoef

import lightning_ft  # registers "ft"
from lightning_ft import FailureInjector, FTStrategy, ReplicaConsistencyCheck
from lightning_ft.callbacks import SyncCallback
from lightning_ft.manager.internals import cross_group_process_group, manager_client
from lightning_ft_job import events


class Regressor(pl.LightningModule):
    def __init__(
        self,
        lr: float = 0.01,
        manual: bool = False,
        sync_train_log: bool = False,
        optimizer: str = "adamw",
        hidden: int = 32,
        batchnorm: bool = False,
        optimizers: int = 1,
        unused_bias_at_step: int | None = None,
        branch: bool = False,
    ) -> None:
        super().__init__()
        self.optimizer_count = optimizers
        self.unused_bias_at_step = unused_bias_at_step
        # BatchNorm: buffers (running statistics) that each group's forward pass changes from its own batch
        norm = [torch.nn.BatchNorm1d(hidden)] if batchnorm else []
        # (no bias before a BatchNorm, as usual: its gradient is zero up to rounding, which Adam would amplify)
        first = torch.nn.Linear(16, hidden, bias=not batchnorm)
        self.net = torch.nn.Sequential(first, *norm, torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        # A residual branch between the hidden layer and the head, a module of its own: with it, the step of
        # ``unused_bias_at_step`` skips the whole branch (an expert no sample reached) instead of the head's bias.
        self.branch = torch.nn.Linear(hidden, hidden) if branch else None
        self.lr = lr
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual
        self.sync_train_log = sync_train_log
        # torchmetrics with "sum" states (MSE) and "cat" states of uneven length per replica (Spearman)
        self.val_mse, self.test_mse = MeanSquaredError(), MeanSquaredError()
        self.val_spearman, self.test_spearman = SpearmanCorrCoef(), SpearmanCorrCoef()

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]  # an indexed dataset adds the sample ids
        if self.branch is not None:  # the branch's module is left out of one step, or none
            features = self.net[:-1](x)
            if self.global_step != self.unused_bias_at_step:
                features = features + self.branch(features)
            prediction = self.net[-1](features)
        elif self.global_step == self.unused_bias_at_step:  # a step in which one parameter gets no gradient
            last = self.net[-1]
            prediction = torch.nn.functional.linear(self.net[:-1](x), last.weight)
        else:
            prediction = self.net(x)
        loss = torch.nn.functional.mse_loss(prediction, y)
        self.log("train_loss", loss, batch_size=len(x))
        if self.sync_train_log:
            self.log("train_loss_all", loss, sync_dist=True)
            self.log("train_loss_max", loss, sync_dist=True, reduce_fx="max")
        if not self.automatic_optimization:
            optimizers = self.optimizers()
            for index, optimizer in enumerate(optimizers if isinstance(optimizers, list) else [optimizers]):
                if index:  # another forward pass for the next optimizer, as a GAN's second player makes
                    loss = torch.nn.functional.mse_loss(self.net(x), y)
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate("val", batch, self.val_mse, self.val_spearman)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate("test", batch, self.test_mse, self.test_spearman)

    def _evaluate(
        self, stage: str, batch: tuple[torch.Tensor, torch.Tensor], mse: MeanSquaredError, spearman: SpearmanCorrCoef
    ) -> None:
        x, y = batch
        prediction = self.net(x)
        self.log(f"{stage}_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        mse.update(prediction, y)
        spearman.update(prediction.squeeze(-1), y.squeeze(-1))
        self.log(f"{stage}_mse", mse)
        self.log(f"{stage}_spearman", spearman)

    def configure_optimizers(self) -> Any:
        if self.optimizer_count == 2:  # the first layer's parameters, then the rest
            first = list(self.net[0].parameters())
            rest = [p for p in self.parameters() if all(p is not q for q in first)]
            return [torch.optim.AdamW(first, lr=self.lr), torch.optim.AdamW(rest, lr=self.lr)]
        if self.optimizer_name == "sgd":  # the numerics test: a step is lr × gradient, so gradient errors show
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class IteratorRegressor(Regressor):
    """``training_step(self, dataloader_iter)``: the step fetches its own batch (Lightning tells by the name)."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


class WarmupRegressor(Regressor):
    """A module that keeps its own training state through Lightning's checkpoint hooks, as many LLM recipes keep their
    iteration count: it counts the batches it trained and warms its loss up from that count. Not in ``state_dict()``:
    only ``on_save_checkpoint`` / ``on_load_checkpoint`` carry it."""

    WARMUP_BATCHES = 16

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batches_seen = 0

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * min(1.0, (self.batches_seen + 1) / self.WARMUP_BATCHES)

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches_seen += 1

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["batches_seen"] = self.batches_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.batches_seen = checkpoint["batches_seen"]


def dataset(size: int = 8192) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 16, generator=generator)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)


def validation_dataset() -> TensorDataset:
    """128 samples: every replica of a 2-group or 2×2 job gets whole batches and no padding, so a job-wide metric
    equals the metric over this dataset."""
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(128, 16, generator=generator)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(128, 1, generator=generator))


class IndexedDataset(Dataset):
    """Samples that carry their own index, so the test can tell exactly which samples each group trained on.

    Its ``state_dict`` names the replica group, which makes it part of a ``StatefulDataLoader``'s state: a group
    handed another group's loader state stops here instead of silently reading from the wrong position.
    """

    def __init__(self, size: int, group: int) -> None:
        self.inner, self.group = dataset(size), group

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.inner[index]
        return x, y, index

    def state_dict(self) -> dict:
        return {"replica_group": self.group}

    def load_state_dict(self, state: dict) -> None:
        if state["replica_group"] != self.group:
            raise RuntimeError(f"group {self.group} was given group {state['replica_group']}'s loader state")
        events.emit("loader_state_loaded", replica_group=state["replica_group"])


class ShardedStream(IterableDataset):
    """An IterableDataset that shards its samples itself: by torch.distributed's rank and world size (which under
    FTStrategy describe the group), or by ``lightning_ft.job_shard()`` (the job)."""

    def __init__(self, inner: Dataset, by: str) -> None:
        self.inner, self.by = inner, by

    def __iter__(self):
        if self.by == "job":
            shard = lightning_ft.job_shard()
            rank, world_size = shard.rank, shard.world_size
        else:
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for index in range(rank, len(self.inner), world_size):
            yield self.inner[index]


class UserData(pl.LightningDataModule):
    """Data code written for plain DDP, built where users build it (``train_dataloader``, after the process group
    exists): ``sampler`` a ``DistributedSampler(dataset)`` of the user's own; ``rank-iterable`` and ``job-iterable``
    a :class:`ShardedStream` by torch.distributed's rank or by the job's."""

    def __init__(self, kind: str, train_data: Dataset, batch_size: int) -> None:
        super().__init__()
        self.kind, self.train_data, self.batch_size = kind, train_data, batch_size

    def train_dataloader(self) -> DataLoader:
        if self.kind == "sampler":
            sampler = DistributedSampler(self.train_data, shuffle=True, seed=0)
            return DataLoader(self.train_data, batch_size=self.batch_size, sampler=sampler)
        by = {"rank-iterable": "torch", "job-iterable": "job"}[self.kind]
        return DataLoader(ShardedStream(self.train_data, by), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(validation_dataset(), batch_size=self.batch_size)


class RecordBatches(pl.Callback):
    """Record the sample ids of every training batch, twice.

    * ``trained``, before the batch's gradient can leave this process: the step, its quorum, whether this group
      contributes (``replica_rank``), the committed position (``cursor``) and the ids. If any group then commits
      that step under that quorum, every participant's gradient was in its average (an allreduce completes only
      with all of them), so the record counts even when this process is killed before the vote. Taken at batch
      start with a synchronous quorum (formed by then); with an asynchronous one, before the optimizer step (the
      record may then miss a contribution sent just before a kill; no test relies on it there). With gradient
      accumulation the ids are those of the optimizer step's micro-batches so far, so the last record of a step holds
      every sample its gradient was accumulated from.
    * ``batch``, at the batch end: the committed step after it, the loop position, the ids, and the vote.
    """

    def __init__(self, quorum_formed_at_batch_start: bool, accumulate: int = 1) -> None:
        self._at_batch_start = quorum_formed_at_batch_start
        self._accumulate = accumulate
        self._window: list[int] = []  # the ids of this optimizer step's micro-batches so far
        self._ids: list[int] = []
        self._key: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        self._window.extend(batch[2].tolist())
        self._ids = list(self._window)
        self._key = {}
        if self._at_batch_start:
            self._record(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if not self._at_batch_start:
            self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        manager = trainer.strategy.manager
        self._key = {"vote_step": manager.current_step(), "quorum_id": manager.quorum_id()}
        events.emit(
            "trained",
            **self._key,
            cursor=manager.batches_committed(),
            epoch=trainer.current_epoch,
            replica_rank=manager.participating_rank(),
            participants=manager.num_participants(),
            ids=self._ids,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        window_end = (trainer.fit_loop.batch_idx + 1) % self._accumulate == 0  # the optimizer step's last micro-batch
        events.emit(
            "batch",
            **self._key,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=trainer.fit_loop.batch_idx,
            ids=batch[2].tolist(),
            # None before the window's last micro-batch: the step has not been voted on yet
            committed=trainer.strategy.step_protocol.last_step_committed if window_end else None,
        )
        if window_end:
            self._window = []


def due(global_step: int, hold: str) -> bool:
    """Whether a ``from_step`` hold ("N" or "N P R", see ``TestGates``) stops a group at ``global_step``."""
    first, *cycle = (int(part) for part in hold.split())
    return global_step >= first and (not cycle or global_step % cycle[0] == cycle[1])


class TestGates(pl.Callback):
    """File gates the test controls, each waited on with a deadline.

    * ``<dir>/go``: training starts only once it exists. The test creates it when every group's Manager is up, so
      the first quorum includes every group and no group races ahead alone.
    * ``<dir>/pause.group<G>``: while it exists, group G stops between batches (its Manager keeps heartbeating).
    * ``<dir>/pause.group<G>.rank<R>``: the same for one rank; it emits a ``paused`` event when it stops.
    * ``<dir>/pause.group<G>.from_step`` holding a number N: group G stops after the batch that takes its
      ``global_step`` to N or beyond, and stays there while the file exists and still holds it there (``paused``
      event); rewritten with a later N, it moves the hold on. Written before a
      fault, it holds a fast survivor at a known step, where a gate touched after the fault might come too late.
      "N P R" stops only at a ``global_step`` >= N that is R modulo P (a step where no delayed sync is in flight).
      In a group of several processes, rank 0's read decides for every rank of the group.
    * ``<dir>/pause.group<G>.validation``: group G stops inside its next validation batch (``paused`` event).
    * ``<dir>/pause.group<G>.batch_start``: group G stops at the start of its next batch, after every save of the
      batches before it (``paused`` event).
    * ``<dir>/pause.group<G>.micro_batch`` holding k: group G stops at the start of its next batch that is micro-batch
      k of an accumulation window (``batch_idx % accumulate_grad_batches == k``; ``paused`` event).
    * ``<dir>/pause.group<G>.allreduce``: group G stops in its next cross-group allreduce, before handing it to the
      process group: its peers are left waiting in theirs (``paused`` event).
    * ``<dir>/pause.group<G>.section``: the same for its next cross-group allreduce outside a step's quorum: a sync
      section's (validation's), on group rank 0, the rank that exchanges in sections.
    * ``<dir>/pause.group<G>.quorum``: group G stops with its next quorum's answer in hand, before acting on it.
    * ``<dir>/pause.group<G>.heal_send``: when group G next serves its state to a healing group over HTTP, it sends
      the first half of the bytes and stops there (``paused`` event), the healing group's fetch still open.
    * ``<dir>/pause.group<G>.last_ckpt_write``: when group G next writes ``last.ckpt``, it writes the first half of
      the bytes to the temporary file and stops there (``paused`` event with the file's ``path``).
    """

    def __init__(self, directory: str, group: int, deadline_s: float = 120.0) -> None:
        self.directory, self.group, self.deadline_s = Path(directory), group, deadline_s
        self.rank = int(os.environ.get("RANK", 0))

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.deadline_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"test gate: {what} did not happen within {self.deadline_s}s")
            time.sleep(0.01)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        events.emit("rank_zero", rank_zero=rank_zero_only.rank == 0)
        # Every cross-group allreduce (the DDP comm hook's, Manager.allreduce's) goes through torchft's process group.
        process_group = cross_group_process_group(trainer.strategy.manager)
        allreduce = process_group.allreduce
        pause = self.directory / f"pause.group{self.group}.allreduce"
        section_pause = self.directory / f"pause.group{self.group}.section"
        protocol = trainer.strategy.step_protocol

        def pausing_allreduce(*args: Any, **kwargs: Any) -> Any:
            if pause.exists():
                events.emit("paused", phase="allreduce", step=trainer.global_step)
                self._wait(lambda: not pause.exists(), f"{pause} to disappear")
            if section_pause.exists() and not protocol.quorum_open:  # a sync section's (validation's) collective
                events.emit("paused", phase="section", step=trainer.global_step)
                self._wait(lambda: not section_pause.exists(), f"{section_pause} to disappear")
            return allreduce(*args, **kwargs)

        process_group.allreduce = pausing_allreduce
        self._pause_quorum_answers(trainer)
        self._pause_heal_sends(trainer)
        self._pause_last_checkpoint_writes(trainer)
        go = self.directory / "go"
        self._wait(go.exists, f"{go} to appear")

    def _send_half_then_pause(self, payload: bytes, stream: Any, pause: Path, **fields: Any) -> None:
        stream.write(payload[: len(payload) // 2])
        stream.flush()
        events.emit("paused", **fields)
        self._wait(lambda: not pause.exists(), f"{pause} to disappear")
        stream.write(payload[len(payload) // 2 :])

    def _pause_quorum_answers(self, trainer: pl.Trainer) -> None:
        """Hold the Manager's quorum thread with the lighthouse's answer in hand, before the group acts on it (heals,
        rebuilds its process group, joins the step's allreduce), while the others already do: the moment a group
        dies "inside a quorum request". Wraps the Manager's (Python) client, a test-only patch."""
        client = manager_client(trainer.strategy.manager)
        quorum = client._quorum
        pause = self.directory / f"pause.group{self.group}.quorum"

        def pausing_quorum(*args: Any, **kwargs: Any) -> Any:
            answer = quorum(*args, **kwargs)
            if pause.exists():
                events.emit("paused", phase="quorum", step=trainer.global_step)
                self._wait(lambda: not pause.exists(), f"{pause} to disappear")
            return answer

        with contextlib.suppress(AttributeError):  # torchft's own (native) client, unwrapped: no gate then
            client._quorum = pausing_quorum

    def _pause_heal_sends(self, trainer: pl.Trainer) -> None:
        """The HTTP transport's handler thread streams the state with ``_streaming_save``: wrap it while the gate
        exists (a test-only patch of torchft's module)."""
        import torchft.checkpointing.http_transport as http_transport

        save = http_transport._streaming_save
        pause = self.directory / f"pause.group{self.group}.heal_send"

        def pausing_save(state: Any, stream: Any, *args: Any, **kwargs: Any) -> None:
            if not pause.exists():
                return save(state, stream, *args, **kwargs)
            buffer = io.BytesIO()
            save(state, buffer, *args, **kwargs)
            self._send_half_then_pause(buffer.getvalue(), stream, pause, phase="heal_send", step=trainer.global_step)

        http_transport._streaming_save = pausing_save

    def _pause_last_checkpoint_writes(self, trainer: pl.Trainer) -> None:
        """``AtomicCheckpointIO`` writes ``torch.save(checkpoint, <open temporary file>)``: wrap ``torch.save`` for
        a temporary file of ``last.ckpt`` while the gate exists."""
        save = torch.save
        pause = self.directory / f"pause.group{self.group}.last_ckpt_write"

        def pausing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            name = getattr(f, "name", f)
            name = os.readlink(f"/proc/self/fd/{name}") if isinstance(name, int) else str(name)  # os.fdopen's file
            if not (pause.exists() and ".last.ckpt." in name and name.endswith(".partial")):
                return save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            fields = {"phase": "last_ckpt_write", "step": trainer.global_step, "path": name}
            self._send_half_then_pause(buffer.getvalue(), f, pause, **fields)

        torch.save = pausing_save

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        pause = self.directory / f"pause.group{self.group}.validation"
        if pause.exists():
            events.emit("paused", phase="validation", step=trainer.global_step)
            self._wait(lambda: not pause.exists(), f"{pause} to disappear")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        pause = self.directory / f"pause.group{self.group}.batch_start"
        if pause.exists():
            events.emit("paused", phase="batch_start", step=trainer.global_step)
            self._wait(lambda: not pause.exists(), f"{pause} to disappear")
        micro = self.directory / f"pause.group{self.group}.micro_batch"
        try:
            wanted = int(micro.read_text())
        except (FileNotFoundError, ValueError):
            return
        if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == wanted:
            events.emit("paused", phase="micro_batch", step=trainer.global_step, micro_batch=wanted)
            self._wait(lambda: not micro.exists(), f"{micro} to disappear")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        pause = self.directory / f"pause.group{self.group}"
        self._wait(lambda: not pause.exists(), f"{pause} to disappear")
        rank_pause = self.directory / f"pause.group{self.group}.rank{self.rank}"
        if rank_pause.exists():
            events.emit("paused", step=trainer.global_step)
            self._wait(lambda: not rank_pause.exists(), f"{rank_pause} to disappear")
        from_step = self.directory / f"pause.group{self.group}.from_step"

        def held() -> bool:
            try:
                return due(trainer.global_step, from_step.read_text())
            except FileNotFoundError:
                return False

        stop = held()
        if trainer.world_size > 1:
            # Every rank of the group stops at this batch, or none: a rank that read a gate written a moment after its
            # peer's read would go on into the next step's collectives and wait there, never reaching a batch end.
            stop = trainer.strategy.broadcast(stop)
        if stop:
            events.emit("paused", phase="from_step", step=trainer.global_step)
            self._wait(lambda: not held(), f"{from_step} to disappear or to name a later step")


class RecordMetrics(pl.Callback):
    """Emit the job-wide metrics every replica computed at the end of each validation and test run."""

    def _emit(self, trainer: pl.Trainer, stage: str) -> None:
        if trainer.sanity_checking:
            return
        values = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}_")}
        events.emit("metrics", stage=stage, fn=trainer.state.fn.value, step=trainer.global_step, values=values)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(trainer, "val")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(trainer, "test")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if "train_loss_all" in trainer.callback_metrics:
            values = {k: trainer.callback_metrics[k].item() for k in ("train_loss_all", "train_loss_max")}
            events.emit("metrics", stage="train", fn="fit", step=trainer.global_step, values=values)


class DieAfterJoining(pl.Callback):
    """SIGKILL this process at the start of its first batch (its first quorum asked for, its heal not yet applied with
    asynchronous quorum) in one given restart attempt: a restart that asks to join and dies before it heals."""

    def __init__(self, attempt: int) -> None:
        self.attempt = attempt

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == str(self.attempt):
            events.emit("dying_after_joining", step=trainer.global_step)
            os.kill(os.getpid(), signal.SIGKILL)


class SaveFinalState(pl.Callback):
    """Write every replica's final model, optimizer and scheduler state for the test to compare."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FTStrategy)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if strategy.data_parallel.sharded:
            # The full (unsharded) state, gathered inside the group with torch's own helpers; group rank 0 writes it.
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model = get_model_state_dict(pl_module, options=options)
            optimizers = [get_optimizer_state_dict(pl_module, opt, options=options) for opt in trainer.optimizers]
            if trainer.global_rank != 0:
                return
        else:
            model = pl_module.state_dict()
            optimizers = [optimizer.state_dict() for optimizer in trainer.optimizers]
        state = {
            "model": model,
            "optimizers": optimizers,
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "lrs": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
            "precision": trainer.precision_plugin.state_dict(),  # GradScaler's scale and growth tracker
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "manager_step": strategy.manager.current_step(),
            "batches_committed": strategy.manager.batches_committed(),
            "best_model_score": trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None,
            "best_model_path": trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None,
            # DiLoCo's global parameters and outer optimizer state, which a heal must carry too
            "outer_state": next((cb.outer_state for cb in trainer.callbacks if isinstance(cb, SyncCallback)), None),
            # What the module and the callbacks keep through checkpoint hooks (a WeightAveraging's averaged model)
            "hook_state": hook_state(trainer, pl_module),
            "counter": next((cb.state_dict() for cb in trainer.callbacks if isinstance(cb, BatchCounter)), None),
        }
        name = f"final.group{strategy.replica_group_id}.rank{trainer.global_rank}.pt"
        torch.save(state, self.out_dir / name)


class BatchCounter(pl.Callback):
    """A callback whose state (batches seen) is part of Lightning's checkpoint: what a heal must carry and the
    consistency check must compare."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


def hook_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What ``on_save_checkpoint`` adds to a checkpoint (module, then callbacks), minus the model's own state."""
    checkpoint: dict[str, Any] = {"state_dict": dict(pl_module.state_dict())}
    pl_module.on_save_checkpoint(checkpoint)
    for callback in trainer.callbacks:
        callback.on_save_checkpoint(trainer, pl_module, checkpoint)
    if "current_model_state" in checkpoint:  # WeightAveraging: "state_dict" now holds the averaged model
        del checkpoint["current_model_state"]
    else:
        del checkpoint["state_dict"]
    return checkpoint


def precision_plugin(precision: str) -> Any:
    """Lightning's mixed precision on the CPU; ``16-mixed`` with a CPU GradScaler, whose state a heal carries."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    return MixedPrecision(precision, "cpu", scaler=scaler)


def hold_start(directory: Path, group: int, deadline_s: float = 120.0) -> None:
    """While ``<dir>/hold_start.group<G>`` exists, group G's process waits before it builds its Trainer: a group that
    starts (or whose restart comes) late, for as long as the test says. A marker file tells the test it is held."""
    hold = directory / f"hold_start.group{group}"
    if not hold.exists():
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (directory / f"held_start.group{group}.attempt{attempt}").touch()
    deadline = time.monotonic() + deadline_s
    while hold.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"test gate: {hold} did not disappear within {deadline_s}s")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--async-quorum", type=int, default=1)
    parser.add_argument("--transport", default="http")
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--gate-dir", default=None)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="fit(ckpt_path='last')")
    parser.add_argument("--val-every", type=int, default=None, help="validate every N training batches")
    parser.add_argument("--csv-logs", default=None, help="log every step to a CSVLogger under this directory")
    parser.add_argument("--sync-train-log", action="store_true", help="log the loss with sync_dist=True every step")
    parser.add_argument("--evaluate-after", action="store_true", help="trainer.validate() and .test() after fit")
    parser.add_argument(
        "--monitor-dir",
        default=None,
        help="EarlyStopping on val_loss (stops once it did not rise: mode='max', patience=0) and a top-1 "
        "ModelCheckpoint on val_loss into this directory",
    )
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--index-data", type=int, default=None, help="train on N samples that carry their index")
    parser.add_argument(
        "--stateful-loader",
        nargs="?",
        const="all",
        default=None,
        help="torchdata's StatefulDataLoader: in every group, or in the comma-separated groups given",
    )
    parser.add_argument("--algorithm", default="ddp", help="FTStrategy(algorithm=...): ddp, local_sgd, diloco")
    parser.add_argument("--sync-every", type=int, default=None, help="FTStrategy(sync_every=...)")
    parser.add_argument("--fragments", type=int, default=None, help="FTStrategy(fragments=...) for diloco")
    parser.add_argument("--consistency-every", type=int, default=None, help="ReplicaConsistencyCheck every N steps")
    parser.add_argument("--timeout", type=float, default=30, help="FTStrategy(timeout=...) for collectives")
    parser.add_argument("--inject", default=None, help="FailureInjector failures, as JSON: a list of Failure dicts")
    parser.add_argument("--fragment-sync-delay", type=int, default=None, help="FTStrategy(fragment_sync_delay=...)")
    parser.add_argument("--data-parallel", default="ddp", help="FTStrategy(data_parallel=...): ddp or fsdp")
    parser.add_argument("--fsdp-wrap", default=None, help="FTStrategy(fsdp_wrap=[...]), comma-separated")
    parser.add_argument("--optimizer", default="adamw", help="adamw or sgd")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=None, help="the same initial weights in every group")
    parser.add_argument("--hidden", type=int, default=32, help="the hidden layer's width")
    parser.add_argument(
        "--hidden-for-group",
        default=None,
        metavar="G:W",
        help="group G builds a hidden layer of width W instead of --hidden: replicas whose models differ",
    )
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d layer (buffers)")
    parser.add_argument("--optimizers", type=int, default=1, help="2: two optimizers (with --manual, one per forward)")
    parser.add_argument("--iterator-step", action="store_true", help="training_step(self, dataloader_iter)")
    parser.add_argument("--precision", default=None, help="16-mixed: CPU autocast to float16 with a GradScaler")
    parser.add_argument("--compile", action="store_true", help="torch.compile the network (eager backend)")
    parser.add_argument("--buffer-sync", default=None, help="FTStrategy(buffer_sync=...): average or off")
    parser.add_argument(
        "--user-data", default=None, help="data code of the user's own: sampler, rank-iterable or job-iterable"
    )
    parser.add_argument("--quorum-timeout", type=float, default=60, help="FTStrategy(quorum_timeout=...)")
    parser.add_argument("--min-replica-size", type=int, default=None, help="FTStrategy(min_replica_size=...)")
    parser.add_argument("--world-size-mode", default=None, help="FTStrategy(world_size_mode=...)")
    parser.add_argument("--data-mode", default=None, help="FTStrategy(data_mode=...): sharded or exactly_once")
    parser.add_argument(
        "--lighthouse-outage-timeout", type=float, default=None, help="FTStrategy(lighthouse_outage_timeout=...)"
    )
    parser.add_argument("--start-timeout", type=float, default=None, help="FTStrategy(start_timeout=...)")
    parser.add_argument(
        "--find-unused-parameters", type=int, default=None, help="FTStrategy(find_unused_parameters=...): 0 or 1"
    )
    parser.add_argument(
        "--gradient-as-bucket-view", type=int, default=None, help="FTStrategy(gradient_as_bucket_view=...): 0 or 1"
    )
    parser.add_argument(
        "--die-after-joining",
        default=None,
        metavar="G:A",
        help="group G's restart attempt A SIGKILLs itself at its first batch, after asking to join, before healing",
    )
    parser.add_argument(
        "--unused-bias-at-step", type=int, default=None, help="the last layer's bias unused in this step's forward"
    )
    parser.add_argument("--unused-bias-groups", default=None, help="with --unused-bias-at-step: these groups only")
    parser.add_argument(
        "--branch", action="store_true", help="a residual branch module, which --unused-bias-at-step skips instead"
    )
    parser.add_argument("--batch-sleep", type=float, default=0.0, help="sleep this long at each batch's start")
    parser.add_argument(
        "--weight-averaging", choices=["ema", "equal"], default=None, help="Lightning's EMA or equal WeightAveraging"
    )
    parser.add_argument("--hook-counter", action="store_true", help="a module that counts batches in checkpoint hooks")
    parser.add_argument("--counter-callback", action="store_true", help="a callback that counts batches in its state")
    parser.add_argument(
        "--crash-after-fit",
        type=int,
        default=None,
        help="in this group's first life, exit 9 once fit has returned (a teardown that crashes after the end)",
    )
    parser.add_argument(
        "--group-args",
        default=None,
        help="a folder: this group's file args.group<G> there, when it exists as the process starts, adds arguments "
        "(one host's edited configuration; a restart reads it anew)",
    )
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    args = parser.parse_args()
    if args.group_args is not None and (Path(args.group_args) / f"args.group{group}").exists():
        args = parser.parse_args(sys.argv[1:] + (Path(args.group_args) / f"args.group{group}").read_text().split())
    stateful_loader = args.stateful_loader is not None and (
        args.stateful_loader == "all" or str(group) in args.stateful_loader.split(",")
    )
    if args.gate_dir is not None:
        hold_start(Path(args.gate_dir), group)
    # Different initial weights per group (init_sync must make them equal), unless the test needs them known.
    torch.manual_seed(100 + group if args.seed is None else args.seed)
    torch.set_num_threads(1)

    callbacks: list[pl.Callback] = [SaveFinalState(args.out_dir), RecordMetrics()]
    if args.gate_dir is not None:
        callbacks.append(TestGates(args.gate_dir, group))
    if args.monitor_dir is not None:
        callbacks.append(EarlyStopping(monitor="val_loss", mode="max", patience=0))
        callbacks.append(ModelCheckpoint(dirpath=args.monitor_dir, monitor="val_loss", save_top_k=1))
    if args.consistency_every is not None:
        callbacks.append(ReplicaConsistencyCheck(every_n_steps=args.consistency_every))
    if args.weight_averaging == "ema":
        callbacks.append(pl.callbacks.EMAWeightAveraging(decay=0.9))
    elif args.weight_averaging == "equal":
        callbacks.append(pl.callbacks.WeightAveraging())
    if args.counter_callback:
        callbacks.append(BatchCounter())
    if args.inject is not None:
        callbacks.append(FailureInjector(json.loads(args.inject)))
    if args.batch_sleep:
        callbacks.append(pl.callbacks.LambdaCallback(on_train_batch_start=lambda *_: time.sleep(args.batch_sleep)))
    if args.die_after_joining is not None:
        dying_group, dying_attempt = (int(part) for part in args.die_after_joining.split(":"))
        if group == dying_group:
            callbacks.append(DieAfterJoining(dying_attempt))
    if args.index_data is not None:
        sync_quorum = not args.async_quorum or args.data_mode == "exactly_once"
        callbacks.append(RecordBatches(quorum_formed_at_batch_start=sync_quorum, accumulate=args.accumulate))
    if args.ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1, save_last=True)
        )
    # Only passed when set, so that the per-step (ddp) tests build the strategy exactly as before.
    algorithm = {} if args.algorithm == "ddp" else {"algorithm": args.algorithm, "sync_every": args.sync_every}
    if args.fragments is not None:
        algorithm["fragments"] = args.fragments
    if args.fragment_sync_delay is not None:
        algorithm["fragment_sync_delay"] = args.fragment_sync_delay
    if args.lighthouse_outage_timeout is not None:  # only passed when set, as above
        algorithm["lighthouse_outage_timeout"] = args.lighthouse_outage_timeout
    if args.min_replica_size is not None:  # only passed when set, as above
        algorithm["min_replica_size"] = args.min_replica_size
    if args.world_size_mode is not None:
        algorithm["world_size_mode"] = args.world_size_mode
    if args.start_timeout is not None:
        algorithm["start_timeout"] = args.start_timeout
    if args.data_mode is not None:
        algorithm["data_mode"] = args.data_mode
    if args.buffer_sync is not None:
        algorithm["buffer_sync"] = args.buffer_sync
    if args.find_unused_parameters is not None:
        algorithm["find_unused_parameters"] = bool(args.find_unused_parameters)
    if args.gradient_as_bucket_view is not None:
        algorithm["gradient_as_bucket_view"] = bool(args.gradient_as_bucket_view)
    if args.data_parallel != "ddp":  # only passed when set, as above
        algorithm["data_parallel"] = args.data_parallel
        if args.fsdp_wrap:
            algorithm["fsdp_wrap"] = args.fsdp_wrap.split(",")
    trainer = pl.Trainer(
        strategy=FTStrategy(
            **algorithm,
            use_async_quorum=bool(args.async_quorum) and args.data_mode != "exactly_once",
            checkpoint_transport=args.transport,
            timeout=args.timeout,
            quorum_timeout=args.quorum_timeout,
            connect_timeout=30,
        ),
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None if args.val_every else 1,
        limit_val_batches=4 if args.val_every or args.evaluate_after else 0,
        num_sanity_val_steps=0,
        gradient_clip_val=args.clip,
        callbacks=callbacks,
        logger=CSVLogger(args.csv_logs, name="ft") if args.csv_logs else False,
        log_every_n_steps=1,
        enable_checkpointing=args.ckpt_dir is not None or args.monitor_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=not stateful_loader,
        plugins=[precision_plugin(args.precision)] if args.precision else None,
    )
    train_data = dataset() if args.index_data is None else IndexedDataset(args.index_data, group)
    if stateful_loader:  # as docs/checkpointing.md shows: a sampler over this rank's shard of the whole job
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        sampler_kwargs = trainer.strategy.distributed_sampler_kwargs
        sampler = StatefulDistributedSampler(train_data, shuffle=True, seed=0, **sampler_kwargs)
        loader = StatefulDataLoader(train_data, batch_size=args.batch_size, sampler=sampler)
    else:
        loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(validation_dataset(), batch_size=args.batch_size)
    if args.seed is not None:  # the weights a test can rebuild: nothing above may draw from the generator first
        torch.manual_seed(args.seed)
    hidden = args.hidden
    if args.hidden_for_group is not None:
        odd_group, width = (int(part) for part in args.hidden_for_group.split(":"))
        hidden = width if group == odd_group else hidden
    model = (IteratorRegressor if args.iterator_step else WarmupRegressor if args.hook_counter else Regressor)(
        lr=args.lr,
        manual=args.manual,
        sync_train_log=args.sync_train_log,
        optimizer=args.optimizer,
        hidden=hidden,
        batchnorm=args.batchnorm,
        optimizers=args.optimizers,
        unused_bias_at_step=(
            args.unused_bias_at_step
            if args.unused_bias_groups is None or str(group) in args.unused_bias_groups.split(",")
            else None
        ),
        branch=args.branch,
    )
    if args.compile:  # dynamo's capture and its OptimizedModule (state-dict names with _orig_mod.); no inductor
        model.net = torch.compile(model.net, backend="eager")
    resume = "last" if args.resume else None
    if args.user_data is not None:
        trainer.fit(model, datamodule=UserData(args.user_data, train_data, args.batch_size), ckpt_path=resume)
    else:
        trainer.fit(model, loader, val_loader, ckpt_path=resume)
    if args.evaluate_after:
        trainer.validate(model, val_loader)
        trainer.test(model, val_loader)
    if args.crash_after_fit == group and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os._exit(9)


def exit_without_teardown_once_main_returned(returned: list[bool]) -> None:
    """An atexit hook, registered before ``main`` so that it runs last: after ``main`` returned, end the process
    without the interpreter's teardown.

    Tearing down torch, Lightning and torch._dynamo frees millions of objects: about 1.5 s of CPU per process on
    the 2-core test machine, paid by every worker of every job, which the tests wait for. What still runs first:
    ``main``, the joins of non-daemon threads (a worker that leaves one running still never exits) and every atexit
    hook registered after this one (Lightning's ``destroy_process_group`` among them). A worker whose ``main``
    raised goes through the normal exit, with its traceback and exit code 1. The user's path, a script that exits
    normally, is what ``examples/train.py`` runs in the CLI tests and in ``make demo``."""
    if returned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main_returned: list[bool] = []
    atexit.register(exit_without_teardown_once_main_returned, main_returned)
    main()
    main_returned.append(True)

"""One job, one contract: every replica group of a job is set up to train the same thing.

The groups of one job are started separately (one torchrun per group, often one host each), each from its own copy
of the configuration. A host whose copy was edited (a longer ``max_steps``, another precision, another accumulation)
would otherwise train as part of the job and end as another model: a group with a higher ``max_steps`` trains on
alone after its peers stop. So the settings that decide what a job trains are compared across groups, and a group
that differs stops before its first step with a :class:`JobContractError` that names each differing setting and both
values.

**What is compared** (:func:`describe_job`): Lightning's stop conditions (``max_steps``, ``max_epochs``,
``min_steps``, ``min_epochs``, ``max_time``), ``accumulate_grad_batches``, precision, gradient clipping, the training
loader's batch size and batches per epoch, the validation cadence, the model's structure (every parameter's and
buffer's name, shape and dtype), the callbacks whose state Lightning's checkpoint holds, and FTStrategy's own settings
that must agree (:func:`strategy_contract`). Everything else may differ between groups:
paths, loggers, progress bars, checkpoint callbacks, timeouts, addresses (``docs/your-code.md``).

**When** (one rule for every group):

* **At the job's start** (a quorum at committed step 0), every group of the quorum sends its settings to every other
  (:meth:`JobContractCheck.quorum_formed`, as soon as the quorum is known, before the forward pass). A group that
  differs from a strict majority stops; the groups that agree fail that one step, and go on without it. Without a
  strict majority (two groups that disagree) every group stops: nothing can tell which one is right.
* **When a group joins a running job** (a restart, a late start), it heals from a live peer, and the heal carries
  the job's settings beside the training state (:data:`CONTRACT_KEY`). The healing group compares them with its own
  before it loads anything or exchanges anything with its peers (:meth:`JobContractCheck.check_peer`): the live peer
  is part of the job that has been committing steps, so its settings are the job's.

A whole job restarted with a new setting (every group resumed with a longer ``max_steps``) agrees with itself and
goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    Checkpoint,
    DeviceStatsMonitor,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed import AllreduceOptions, ReduceOp
from torch.utils.data import DataLoader

from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.errors import LightningFTError
from lightning_ft.hsdp.data_parallel import DataParallelSettings
from lightning_ft.manager import FTManager
from lightning_ft.manager.ft_manager import QuorumSeen
from lightning_ft.manager.internals import cross_group_process_group
from lightning_ft.settings import FTSettings
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")

# The key of the job's settings among the states a heal carries (torchft's user state dict).
CONTRACT_KEY = "lightning_ft_job_contract"

_SUM = AllreduceOptions()
_SUM.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch stubs type it as the enum class, not its value

# Callbacks that write, show or save, and do not change what is trained: they may differ between groups (a group may
# keep its own checkpoints, at its own cadence, in its own folder).
MAY_DIFFER_CALLBACKS: tuple[type[pl.Callback], ...] = (
    Checkpoint,
    ProgressBar,
    ModelSummary,
    LearningRateMonitor,
    DeviceStatsMonitor,
)


class JobContractError(LightningFTError, ValueError):
    """This replica group is set up for another job than its peers: a setting that every group must share differs."""


@dataclass(frozen=True)
class JobContract:
    """The settings that decide what one job trains, each as a short, comparable text."""

    settings: dict[str, str]

    def differences(self, other: JobContract) -> list[tuple[str, str, str]]:
        """``(setting, this value, other value)`` for each setting that differs, in a fixed order."""
        names = sorted(set(self.settings) | set(other.settings))
        missing = "(not set)"
        return [
            (name, self.settings.get(name, missing), other.settings.get(name, missing))
            for name in names
            if self.settings.get(name) != other.settings.get(name)
        ]

    def to_bytes(self, group: int) -> bytes:
        return json.dumps({"group": group, "settings": self.settings}, sort_keys=True).encode()

    @staticmethod
    def from_bytes(payload: bytes) -> tuple[int, JobContract]:
        decoded = json.loads(payload.decode())
        return int(decoded["group"]), JobContract(dict(decoded["settings"]))


def describe_job(trainer: pl.Trainer, strategy_settings: dict[str, Any]) -> JobContract:
    """The job's contract as this group sees it: Lightning's settings from ``trainer``, and the strategy's own that
    must agree. Read once the training loader is set up (batch size, batches per epoch)."""
    fit_loop = trainer.fit_loop
    settings: dict[str, Any] = {
        "max_steps": trainer.max_steps,
        "max_epochs": trainer.max_epochs,
        "min_steps": fit_loop.min_steps,
        "min_epochs": trainer.min_epochs,
        "max_time": _max_time(trainer),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "precision": trainer.precision,
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
        "train batch size": _batch_sizes(trainer.train_dataloader),
        "train batches per epoch": trainer.num_training_batches,
        "val_check_interval": trainer.val_check_interval,
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
        "limit_val_batches": trainer.limit_val_batches,
        "model structure": _model_structure(trainer.lightning_module),
        "callbacks": _stateful_callbacks(trainer),
    }
    settings.update({f"FTStrategy {name}": value for name, value in strategy_settings.items()})
    return JobContract({name: _text(value) for name, value in settings.items()})


def strategy_contract(
    settings: FTSettings,
    algorithm: AlgorithmSettings,
    data_parallel: DataParallelSettings,
    data_mode: str,
    ddp_kwargs: dict[str, Any],
    group_size: int,
) -> dict[str, Any]:
    """FTStrategy's settings that every group must share: those that decide the job's data shards, which steps
    commit, how groups synchronise and how gradients are laid out for the cross-group allreduce. The others (the
    group's id, addresses, timeouts, the lighthouse) are the group's own."""
    contract: dict[str, Any] = {
        "num_replica_groups": settings.num_replica_groups,
        "processes per group": group_size,
        "min_replica_size": settings.min_replica_size,
        "world_size_mode": settings.world_size_mode,
        "init_sync": settings.init_sync,
        "use_async_quorum": settings.use_async_quorum,
        "skip_non_finite_steps": settings.skip_non_finite_steps,
        "buffer_sync": settings.buffer_sync,
        "process_group": settings.process_group,
        "checkpoint_transport": settings.checkpoint_transport,
        "data_mode": data_mode,
        "algorithm": algorithm.algorithm,
        "sync_every": algorithm.sync_every,
        "outer_optimizer": algorithm.outer_optimizer,
        "fragments": algorithm.fragments,
        "fragment_sync_delay": algorithm.fragment_sync_delay,
        "fragment_update_alpha": algorithm.fragment_update_alpha,
        "quantize": algorithm.quantize,
        "data_parallel": data_parallel.data_parallel,
        "fsdp": repr(data_parallel.fsdp) if data_parallel.fsdp is not None else None,
    }
    # The gradient bucket layout: DDP's buckets are what crosses groups, one allreduce each.
    for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
        contract[name] = ddp_kwargs.get(name)
    return contract


def install_contract_check(
    trainer: pl.Trainer,
    strategy_settings: dict[str, Any],
    manager: FTManager,
    group: int,
    num_groups: int,
) -> JobContractCheck:
    """Compare this group's contract at the job's start (every step-0 quorum) and at every heal."""
    check = JobContractCheck(
        lambda: describe_job(trainer, strategy_settings), manager, group, num_groups, trainer.strategy.root_device
    )
    # Registered before the training state: its check runs first, so a group of another job is told why.
    manager.register_state_dict_fn(CONTRACT_KEY, check.load, check.state)
    manager.register_heal_check(CONTRACT_KEY, check.check_peer)
    manager.add_quorum_observer(check)
    return check


def _text(value: Any) -> str:
    """A value as the error shows it, the same text in every process for the same value (no addresses)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_text(item)}" for key, item in sorted(value.items())) + "}"
    if callable(value):
        return str(getattr(value, "__qualname__", type(value).__qualname__))
    return repr(value)


def _max_time(trainer: pl.Trainer) -> float | None:
    """``Trainer(max_time=...)`` in seconds: Lightning keeps it in its ``Timer`` callback, whose remaining and elapsed
    times add up to it."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # a list of callbacks at runtime
        if isinstance(callback, Timer):
            remaining = callback.time_remaining()
            return None if remaining is None else round(remaining + callback.time_elapsed())
    return None


def _batch_sizes(loaders: Any) -> list[int | None]:
    """The batch size of each training loader (``trainer.train_dataloader``: one, or a collection of them)."""
    return [_batch_size(loader) for loader in _loaders(loaders)]


def _loaders(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _loaders(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _loaders(item)
    elif value is not None:
        yield value


def _batch_size(loader: Any) -> int | None:
    if isinstance(loader, DataLoader):
        if loader.batch_size is not None:
            return loader.batch_size
        return getattr(loader.batch_sampler, "batch_size", None)
    return getattr(loader, "batch_size", None)


def _model_structure(module: pl.LightningModule) -> str:
    """Every parameter's and buffer's name, shape and dtype, as a count and a digest (the same in every group of one
    job; an FSDP shard reports its whole parameter's shape)."""
    entries = [
        f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}"
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
        for name, tensor in named
    ]
    elements = sum(tensor.numel() for tensor in module.parameters())
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:12]
    return f"{len(entries)} tensors, {elements} parameter elements, digest {digest}"


def _stateful_callbacks(trainer: pl.Trainer) -> list[str]:
    """The callbacks whose state Lightning's checkpoint holds (a ``state_dict()`` or an ``on_save_checkpoint``), by
    ``state_key``, except those that may differ between groups (:data:`MAY_DIFFER_CALLBACKS`) and Lightning's
    ``Timer``, whose one setting is ``max_time``."""
    keys = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # a list of callbacks at runtime
        if isinstance(callback, (*MAY_DIFFER_CALLBACKS, Timer)):  # Timer: compared as max_time
            continue
        if callback.state_dict() or is_overridden("on_save_checkpoint", callback, pl.Callback):
            keys.append(callback.state_key)
    return sorted(keys)


class JobContractCheck:
    """Compares this group's contract with its peers', at the job's start and when this group joins a running job.

    A :class:`~lightning_ft.manager.ft_manager.QuorumObserver` of the group's Manager: it hears of every new quorum
    on the training thread, before anything received in that quorum is vetted or loaded.

    Args:
        describe: This group's contract (:func:`describe_job`), read when first needed and kept.
        manager: The group's Manager.
        group: This group's id.
        num_groups: How many replica groups the job has (every group id is below it).
        device: Where the exchange's buffers live (the cross-group process group's device).
    """

    def __init__(
        self,
        describe: Callable[[], JobContract],
        manager: FTManager,
        group: int,
        num_groups: int,
        device: torch.device,
    ) -> None:
        self._describe = describe
        self._contract: JobContract | None = None
        self.manager = manager
        self.group = group
        self.num_groups = num_groups
        self.device = device

    @property
    def contract(self) -> JobContract:
        if self._contract is None:
            self._contract = self._describe()
        return self._contract

    # ------------------------------------------------------------------ when a group joins a running job
    def state(self) -> dict[str, Any]:
        """What a heal carries beside the training state: the committed step and the job's settings."""
        return {"step": self.manager.current_step(), "group": self.group, "settings": self.contract.settings}

    def load(self, state: dict[str, Any]) -> None:
        """Nothing to load: the settings were compared (:meth:`check_peer`) before the heal went on."""

    def check_peer(self, state: dict[str, Any]) -> None:
        """Raise :class:`JobContractError` if the live peer this group heals from runs another job. Not at committed
        step 0, where the start's vote (:meth:`quorum_formed`) has decided by majority. The model's structure is left
        to the training state's own check, which runs next and names each parameter and both shapes."""
        if int(state["step"]) == 0:
            return
        peer = JobContract(dict(state["settings"]))
        differences = [entry for entry in self.contract.differences(peer) if entry[0] != "model structure"]
        if not differences:
            return
        where = f"the running job (it heals from replica group {state['group']} at committed step {state['step']})"
        self._refuse(differences, where, [int(state["group"])])

    # ------------------------------------------------------------------ at the job's start
    def quorum_waited(self, seconds: float) -> None:
        """Not needed here."""

    def quorum_formed(self, quorum: QuorumSeen) -> None:
        """At a quorum at committed step 0, every group of it compares its contract with every other's, before the
        quorum's heal (``init_sync``) is vetted or loaded and before the forward pass. Every participant of such a
        quorum does: each knows the quorum and the step here (torchft's quorum is waited for before the first forward
        pass at step 0), and hears of each quorum once. A failed exchange decides nothing; the step fails with it, and
        the next quorum votes again.

        When some group differs, that group stops, and the others fail this step and drop the state they may have
        received in it (it may come from that group): the next quorum, without it, starts the job again."""
        mine = self.contract  # read here, on the training thread, before a peer's heal asks for it on another
        manager = self.manager
        if manager.current_step() != 0 or manager.errored() is not None:
            return
        received = self._exchange(mine.to_bytes(self.group))
        if received is None:
            return
        contracts = {group: JobContract.from_bytes(payload)[1] for group, payload in received.items()}
        contracts[self.group] = mine
        odd = self._decide(contracts)
        if odd:
            manager.discard_heal(JobContractError(f"replica group(s) {odd} are set up for another job"))

    def _exchange(self, payload: bytes) -> dict[int, bytes] | None:
        """Every member's payload, by group id, over the quorum's process group: each member fills its own group's
        slot of a zeroed buffer, and a sum gathers them. Every member takes part, a healing one too (torchft's
        ``Manager.allreduce`` zeroes a member that heals in this quorum). ``None`` when the exchange failed, after
        reporting the error to the Manager: the step fails, and the next quorum exchanges again."""
        lengths = torch.zeros(self.num_groups, dtype=torch.int64, device=self.device)
        lengths[self.group] = len(payload)
        if not self._sum(lengths):
            return None
        slots = torch.zeros(self.num_groups, int(lengths.max()), dtype=torch.uint8, device=self.device)
        slots[self.group, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        if not self._sum(slots):
            return None
        host = slots.cpu()
        received = {
            group: host[group, : int(length)].numpy().tobytes()
            for group, length in enumerate(lengths.tolist())
            if length and group != self.group
        }
        try:
            for payload in received.values():
                JobContract.from_bytes(payload)
        except (ValueError, KeyError) as error:  # two members wrote one slot: a group id claimed twice
            self.manager.report_error(RuntimeError(f"the job's start vote exchanged unreadable settings: {error}"))
            return None
        return received

    def _sum(self, tensor: torch.Tensor) -> bool:
        try:
            cross_group_process_group(self.manager).allreduce([tensor], _SUM).wait()
        except Exception as error:  # a member died or timed out: the step fails with it, as any collective's would
            self.manager.report_error(error)
            return False
        return True

    def _decide(self, contracts: dict[int, JobContract]) -> list[int]:
        """The groups that differ from a strict majority; raise if this group is one of them, or if there is none."""
        keys = {group: json.dumps(contract.settings, sort_keys=True) for group, contract in contracts.items()}
        majority_key, count = Counter(keys.values()).most_common(1)[0]
        groups = sorted(keys)
        if count == len(keys):
            events.emit("job_contract", groups=groups, agreed=True)
            return []
        if count * 2 <= len(keys):
            events.emit("job_contract", groups=groups, agreed=False, odd=groups, majority=False)
            others = [group for group in groups if keys[group] != keys[self.group]]
            where = f"replica group(s) {others}, and no majority can tell which is right (every group stops)"
            self._refuse(self.contract.differences(contracts[others[0]]), where, others)
        majority = [group for group in groups if keys[group] == majority_key]
        odd = [group for group in groups if keys[group] != majority_key]
        events.emit("job_contract", groups=groups, agreed=False, odd=odd, majority=True)
        if self.group in odd:
            where = f"replica group(s) {majority}, the majority of the job's first quorum"
            self._refuse(self.contract.differences(contracts[majority[0]]), where, majority)
        log.error(
            "lightning-ft: replica group(s) %s are set up for another job than this one and stop; this step fails, "
            "and the job goes on with the groups that agree (%s).",
            odd,
            majority,
        )
        return odd

    def _refuse(self, differences: list[tuple[str, str, str]], where: str, peers: Iterable[int]) -> NoReturn:
        named = "; ".join(f"{name} is {mine} here and {theirs} there" for name, mine, theirs in differences)
        events.emit(
            "contract_refused",
            peers=list(peers),
            differences=[{"setting": name, "here": mine, "there": theirs} for name, mine, theirs in differences],
        )
        raise JobContractError(
            f"lightning-ft: replica group {self.group} is set up for another job than {where}: {named}. Every group "
            f"of one job must agree on these settings (docs/your-code.md, 'What every group must agree on'): fix "
            f"this group's configuration, or restart every group with the new one. This group stops before its "
            f"first step."
        )

"""Rehearse failures on your own job: one replica is killed, raises, hangs, slows down, produces NaN gradients or is
left behind in a collective at a chosen step.

Fault tolerance that is never exercised is fault tolerance nobody knows works. This callback makes a failure happen
exactly where the user asks, inside the real training loop, so that a job can be rehearsed before machines really
die. It only ever acts on the process it runs in; what happens next (torchrun restarting the group, the survivors
carrying on, the heal) is the real thing.

A failure fires once, in the first life of the process (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), unless
``every_attempt=True``: a group that restarts and heals past the step would otherwise never reach it again, and
one that resumes before it would fail forever.

Example (LightningCLI YAML)::

    trainer:
      callbacks:
        - class_path: lightning_ft.FailureInjector
          init_args:
            failures:
              - {kind: kill, group: 1, step: 20}
              - {kind: nan, group: 0, step: 35}
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_ft.callbacks._access import ft_manager, ft_settings
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.manager.internals import cross_group_process_group, intercept_backend_works, process_group_timeout
from lightning_ft.settings import FTConfigError
from lightning_ft_job import events
from lightning_ft_job.environment import ENV_REPLICA_GROUP_ID, torchrun_restart_count

FAILURE_KINDS = ("kill", "raise", "hang", "slow", "nan", "corrupt", "stuck")
FAILURE_MOMENTS = ("batch_start", "allreduce")


class InjectedFailure(RuntimeError):
    """The exception that ``kind="raise"`` raises, so that it is easy to tell apart from a real one."""


@dataclass(frozen=True)
class Failure:
    """One failure of one process.

    Args:
        kind: ``"kill"`` (SIGKILL itself), ``"raise"`` (:class:`InjectedFailure` out of the training loop),
            ``"hang"`` (SIGSTOP itself: every thread stops, heartbeats included, as in a machine that stops
            responding; it continues after ``seconds``, or never if ``seconds`` is ``None``), ``"slow"`` (sleep
            ``seconds`` before each of ``steps`` batches: a straggler), ``"nan"`` (this replica's gradients of that
            step are NaN before they are averaged across groups) or ``"corrupt"`` (one value of this replica's
            training state changes silently, as silent data corruption would do: see ``target`` and
            ``ReplicaConsistencyCheck``) or ``"stuck"``
            (``at="allreduce"`` only: the step's allreduce runs, so the peers complete it, but here it never
            completes, until the collective timeout fails it; the process keeps heartbeating. This is what a
            survivor sees when Gloo loses a send after a peer died mid-allreduce; see
            ``lightning_ft.process_group.left_behind``).
        step: ``trainer.global_step`` at which it fires.
        group: Replica group id; ``None`` for every group.
        rank: Rank inside the group.
        at: ``"batch_start"`` (at the start of the batch, after the FT callbacks opened the step's quorum) or
            ``"allreduce"`` (``kill``/``hang``/``stuck`` only: inside the step's first cross-group allreduce, so that
            the peers are left waiting in the same collective).
        seconds: ``hang``: how long the process stays stopped (``None``: until someone sends SIGCONT).
            ``slow``: the delay before each batch.
        steps: ``slow`` only: how many consecutive steps are slowed down.
        target: ``corrupt`` only: what changes. ``"weights"`` (the first weight), ``"optimizer"`` (the first
            element of the first optimizer's first state tensor, such as Adam's first moment) or
            ``"callback:<state_key>"`` (the first number of that callback's ``state_dict()``, loaded back).

    Raises:
        FTConfigError: A field has a value that cannot work (an unknown ``kind`` or ``at``, a combination that
            cannot fire, a negative ``step``, ``group`` or ``rank``, ``steps`` < 1, ``seconds`` not a positive
            number, ``target`` without ``kind="corrupt"``). The message names the field.
    """

    kind: str
    step: int
    group: int | None = 0
    rank: int = 0
    at: str = "batch_start"
    seconds: float | None = 5.0
    steps: int = 1
    target: str = "weights"

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise FTConfigError(f"Failure(kind={self.kind!r}): must be one of {', '.join(FAILURE_KINDS)}.")
        if self.at not in FAILURE_MOMENTS:
            raise FTConfigError(f"Failure(at={self.at!r}): must be one of {', '.join(FAILURE_MOMENTS)}.")
        if self.at == "allreduce" and self.kind not in ("kill", "hang", "stuck"):
            raise FTConfigError(
                f"Failure(kind={self.kind!r}, at='allreduce'): only kill, hang and stuck can fire there."
            )
        if self.kind == "stuck" and self.at != "allreduce":
            raise FTConfigError("Failure(kind='stuck'): needs at='allreduce', the collective it gets stuck in.")
        if self.step < 0 or self.rank < 0 or (self.group is not None and self.group < 0):
            raise FTConfigError(f"Failure {self}: step, group and rank must be >= 0.")
        if self.steps < 1:
            raise FTConfigError(f"Failure(steps={self.steps}): must be >= 1.")
        if self.seconds is not None and not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise FTConfigError(f"Failure(seconds={self.seconds}): must be a positive number of seconds.")
        if self.target != "weights" and (self.kind != "corrupt" or not _is_corruption_target(self.target)):
            raise FTConfigError(
                f"Failure(kind={self.kind!r}, target={self.target!r}): target is for kind='corrupt' only, and is "
                f"'weights', 'optimizer' or 'callback:<state_key>'."
            )
        if self.kind == "slow" and self.seconds is None:
            raise FTConfigError("Failure(kind='slow'): seconds (the delay per batch) is required.")


class FailureInjector(FTCallback):
    """Fires each :class:`Failure` meant for this process (its group and group rank) at its step.

    Args:
        failures: The failures, as :class:`Failure` objects or dicts of its fields (YAML).
        every_attempt: Fire in every life of the process, not only the first.

    Raises:
        FTConfigError: A failure given as a dict has a field that :class:`Failure` refuses.
        TypeError: A dict has a key that is not a field of :class:`Failure`.
    """

    def __init__(self, failures: list[Failure] | list[dict[str, Any]], every_attempt: bool = False) -> None:
        self.failures = [f if isinstance(f, Failure) else Failure(**f) for f in failures]
        self.every_attempt = every_attempt
        self._mine: list[Failure] = []
        self._fired: set[int] = set()
        self._nan_hooks: list[torch.utils.hooks.RemovableHandle] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: keep the failures meant for this process (its group and group rank, and its life unless
        ``every_attempt``), and hook the cross-group allreduce for those that fire there.

        Raises:
            StrategyRequiredError: A failure fires ``at="allreduce"`` and the strategy has no torchft Manager.
        """
        if stage != "fit":
            return
        settings = ft_settings(trainer)
        group = settings.replica_group_id if settings is not None else int(os.environ.get(ENV_REPLICA_GROUP_ID, 0))
        first_life = torchrun_restart_count() == 0
        self._mine = [
            f
            for f in self.failures
            if (f.group is None or f.group == group)
            and f.rank == trainer.global_rank
            and (first_life or self.every_attempt)
        ]
        if any(f.at == "allreduce" for f in self._mine):
            self._wrap_allreduce(trainer)

    def _due(self, trainer: pl.Trainer, at: str) -> list[Failure]:
        due = []
        for index, failure in enumerate(self._mine):
            if failure.at != at or index in self._fired:
                continue
            if failure.step <= trainer.global_step < failure.step + (failure.steps if failure.kind == "slow" else 1):
                due.append(failure)
                if failure.kind != "slow" or trainer.global_step == failure.step + failure.steps - 1:
                    self._fired.add(index)
        return due

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Fire the failures due at this batch's start. ``kill`` does not return; ``hang`` returns once the process
        is continued.

        Raises:
            InjectedFailure: A ``kind="raise"`` failure is due.
            FTConfigError: A due ``kind="corrupt"`` failure's ``target`` names no state (no optimizer state yet, no
                callback with that ``state_key`` and a number).
        """
        for failure in self._due(trainer, "batch_start"):
            self._fire(failure, trainer, pl_module)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the hooks that made this step's gradients NaN (``kind="nan"``)."""
        for handle in self._nan_hooks:
            handle.remove()
        self._nan_hooks.clear()

    def _wrap_allreduce(self, trainer: pl.Trainer) -> None:
        """Fire inside the cross-group process group's allreduce (torchft's reconfigurable process group, which
        outlives its reconfigurations): every cross-group allreduce passes there, the DDP comm hook's and
        ``Manager.allreduce``'s alike. A ``stuck`` allreduce's completion is withheld below lightning-ft's
        left-behind watch (:func:`intercept_backend_works`), as a Gloo send that never completes would be."""
        process_group = cross_group_process_group(ft_manager(trainer))
        allreduce = process_group.allreduce
        withhold = threading.local()

        def allreduce_with_failures(*args: Any, **kwargs: Any) -> Any:
            stuck = False
            for failure in self._due(trainer, "allreduce"):
                self._fire(failure, trainer, trainer.lightning_module)
                stuck = stuck or failure.kind == "stuck"
            withhold.next_work = stuck
            try:
                return allreduce(*args, **kwargs)
            finally:
                withhold.next_work = False

        def withhold_if_stuck(work: dist.Work) -> dist.Work:
            if getattr(withhold, "next_work", False):
                withhold.next_work = False
                return _CompletionNeverArrives(work, process_group_timeout(process_group))
            return work

        process_group.allreduce = allreduce_with_failures
        intercept_backend_works(process_group, withhold_if_stuck)

    def _fire(self, failure: Failure, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        events.emit("failure_injected", kind=failure.kind, at=failure.at, global_step=trainer.global_step)
        print(
            f"lightning-ft FailureInjector: {failure.kind} at {failure.at} of step {trainer.global_step} "
            f"(pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        if failure.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif failure.kind == "raise":
            raise InjectedFailure(f"lightning-ft FailureInjector: injected exception at step {trainer.global_step}")
        elif failure.kind == "hang":
            _stop_self(failure.seconds)
        elif failure.kind == "stuck":
            pass  # the allreduce wrapper withholds the completion (_CompletionNeverArrives)
        elif failure.kind == "slow":
            assert failure.seconds is not None
            time.sleep(failure.seconds)
        elif failure.kind == "corrupt":
            _corrupt(trainer, pl_module, failure.target)
        elif failure.kind == "nan":
            self._nan_hooks = [
                p.register_hook(lambda grad: torch.full_like(grad, float("nan")))
                for p in pl_module.parameters()
                if p.requires_grad
            ]


def _is_corruption_target(target: str) -> bool:
    return target in ("weights", "optimizer") or (target.startswith("callback:") and len(target) > len("callback:"))


def _corrupt(trainer: pl.Trainer, pl_module: pl.LightningModule, target: str) -> None:
    """Change one value of this replica's training state, silently."""
    with torch.no_grad():
        if target == "weights":
            first = next(p for p in pl_module.parameters() if p.numel())
            first.view(-1)[0] += 1e-3
        elif target == "optimizer":
            states = [s for s in trainer.optimizers[0].state.values() for v in s.values() if _has_floats(v)]
            if not states:
                raise FTConfigError("Failure(target='optimizer'): the first optimizer holds no state tensor yet.")
            tensor = next(v for v in states[0].values() if _has_floats(v))
            tensor.view(-1)[0] += 1e-3
        else:
            key = target.removeprefix("callback:")
            callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
            callback = next((c for c in callbacks if c.state_key == key), None)
            state = callback.state_dict() if callback is not None else {}
            number = next((name for name, value in state.items() if isinstance(value, (int, float))), None)
            if callback is None or number is None or isinstance(state[number], bool):
                raise FTConfigError(f"Failure(target={target!r}): no callback with that state_key and a number.")
            callback.load_state_dict({**state, number: state[number] + 1})


def _has_floats(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0


class _CompletionNeverArrives(dist.Work):
    """A cross-group allreduce that ran (the peers get this replica's contribution) but whose completion never
    arrives here: its future fails after the process group's timeout, as Gloo's stuck send does."""

    def __init__(self, work: dist.Work, timeout: timedelta) -> None:
        super().__init__()
        self._work = work  # the real collective, kept alive until it ends
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._timer = threading.Timer(timeout.total_seconds(), self._time_out, args=(timeout,))
        self._timer.daemon = True
        self._timer.start()

    def _time_out(self, timeout: timedelta) -> None:
        self._future.set_exception(
            RuntimeError(f"lightning-ft FailureInjector: stuck allreduce timed out after {timeout.total_seconds()}s")
        )

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True


def _stop_self(seconds: float | None) -> None:
    """SIGSTOP this process; a detached ``sleep`` sends SIGCONT after ``seconds`` (a stopped process cannot)."""
    if seconds is not None:
        subprocess.Popen(
            ["/bin/sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    os.kill(os.getpid(), signal.SIGSTOP)

"""The communication hook that averages DDP's gradient buckets across replica groups.

Why a DDP hook of our own instead of ``torchft.ddp.DistributedDataParallel``:

* torchft 0.2.0's hook asserts on an internal future (``assert fut._fut``) that is ``None`` when a peer died in the
  middle of the allreduce, so the *survivor* crashes exactly when it should carry on. Here the error is left with
  the Manager (``should_commit()`` will then say no), and the hook's future completes with the bucket as it is.
  Its contents are garbage in that case, which is fine: the step is not committed.
* torchft's cross-group process group only links equal group ranks, so a group of several processes must reduce
  inside the group first, on the group's own process group, and only then across groups.
* torchft's hook waits for each bucket's allreduce before it returns, so no communication overlaps the rest of the
  backward pass. This hook returns the process group's own future instead, with the average and the error capture
  chained to it, as DDP's built-in hooks do: at 50 M parameters that is most of the difference between a step with
  fault tolerance and one without (``docs/benchmarks.md``). It also skips ``Manager.allreduce``'s per-call
  machinery (:func:`cross_group_average`), which on a 1 M-parameter model cost more than the collective itself,
  and on NCCL torchft's timers around each collective: one deadline per step bounds them all
  (:mod:`lightning_ft.process_group.step_deadline`).
* Averaging and the non-finite check of the averaged gradient (``FTStrategy(skip_non_finite_steps=True)``) are one
  pass over each bucket, in the allreduce's completion callback, off the training thread: GradScaler's fused kernel
  (``torch._amp_foreach_non_finite_check_and_unscale_``) multiplies by 1 / (group size × participants) and flags any
  inf or NaN, so the commit gate only reads a flag (:meth:`FTCommState.take_gradient_check`), once the vote has
  synchronized the device. Multiplying by the reciprocal is what DDP's own reducer does; a separate division and sum
  cost twice as much.

With FSDP2 (``data_parallel="fsdp"``) the group reduce-scatters instead, and each module's shards cross groups in
one fixed order: :mod:`lightning_ft.hsdp.cross_group`.
"""

# No `from __future__ import annotations` here: torch's DDP inspects the hook's annotations at registration and
# requires the real GradBucket / Future[Tensor] objects, not strings.
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchft import Manager

from lightning_ft.errors import UnsupportedModelError
from lightning_ft.manager.internals import (
    CROSS_GROUP_SUM,
    cross_group_process_group,
    crosses_groups_over_gloo,
    process_group_timeout,
)
from lightning_ft.manager.vote_fence import VoteFence
from lightning_ft.manager.vote_inputs import host_copy
from lightning_ft.process_group.step_deadline import StepDeadline
from lightning_ft.step.left_out_parameters import LeftOutParameters
from lightning_ft.step.protocol import StepProtocol
from lightning_ft.step.unfinished_reduction import check_reduction_finished
from lightning_ft.torch_internals import non_finite_check_and_unscale, rebuild_ddp_buckets

log = logging.getLogger("lightning.pytorch.lightning_ft")


@dataclass
class FTCommState:
    """What the hook needs: the Manager for the cross-group step and the group's own process group."""

    manager: Manager
    group: dist.ProcessGroup | None
    group_world_size: int
    before_allreduce: Callable[[], None] = lambda: None
    # On NCCL: the step's collectives go straight to the NCCL group, bounded by one deadline per step, armed after the
    # last bucket. ``None`` on Gloo, whose every operation carries ``FTStrategy(timeout=...)`` itself.
    step_deadline: StepDeadline | None = None
    # On NCCL and a CUDA device: the point at the end of the backward pass that the step's vote waits for, instead of
    # every kernel queued before it (lightning_ft.manager.vote_fence). ``None`` elsewhere.
    vote_fence: VoteFence | None = None
    # The group's DDP wrapper, asked after each backward pass whether it reduced every bucket
    # (:meth:`check_reduction_finished`); ``None``: not checked. A weak reference: DDP's C++ reducer holds this state,
    # and a strong one back would make a cycle through C++ that the garbage collector cannot break, keeping every
    # fit's model, Manager and process group (a listening port each) alive after the fit.
    ddp: weakref.ReferenceType[DistributedDataParallel] | None = None
    # The parameters a group left out of a step take the job's average after the backward pass
    # (lightning_ft.step.left_out_parameters). ``None``: not handled (tests of the hook alone).
    left_out: LeftOutParameters | None = None
    # Buckets of the current step checked by the completion callbacks, and their flag (per device, a 1-element
    # float32 tensor as the fused kernel wants): non-zero once any bucket held an inf or NaN. The optimizer step
    # takes the result (see ``take_gradient_check``); DDP has waited for every bucket's future by then.
    checked_buckets: int = 0
    # Cross-group collectives launched for the current step (the ``step`` event's ``cross_group_collectives``): one per
    # DDP bucket, so it shows the bucket layout that crosses groups (``configuration.DEFAULT_BUCKET_CAP_MB``).
    collectives_launched: int = 0
    _non_finite_flags: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def average_in_place(self, buffer: torch.Tensor, divisor: int) -> None:
        """``buffer *= 1 / divisor``, flagging any inf or NaN of the result, in one pass.

        Every group averages with the same arithmetic whatever its ``skip_non_finite_steps``, so the replicas stay
        bit-identical; the flag is simply not read when the guard is off.
        """
        flag = self._non_finite_flags.get(buffer.device)
        if flag is None:
            flag = self._non_finite_flags[buffer.device] = torch.zeros(1, dtype=torch.float32, device=buffer.device)
        reciprocal = torch.full((1,), 1.0 / divisor, dtype=torch.float32, device=buffer.device)
        non_finite_check_and_unscale([buffer], flag, reciprocal)
        self.checked_buckets += 1

    def check_reduction_finished(self) -> None:
        """Raise :class:`~lightning_ft.step.unfinished_reduction.UnusedParameterError` if the latest backward pass
        left buckets that this hook never saw (a parameter without a gradient under ``find_unused_parameters=False``):
        their gradients crossed no group, and the step must not commit."""
        ddp = self.ddp() if self.ddp is not None else None
        if ddp is not None:
            check_reduction_finished(ddp)

    def backward_done(self) -> None:
        """After every backward pass (``FTStrategy.backward``): the parameters this group left out of the step get the
        job's average, as in every other group."""
        if self.left_out is not None:
            self.left_out.give_average()

    def take_collective_count(self) -> int:
        """How many cross-group collectives the current step launched; the count starts over."""
        launched, self.collectives_launched = self.collectives_launched, 0
        return launched

    def take_gradient_check(self) -> Callable[[], bool] | None:
        """The current step's check, once per step (the count and the flags start over): a function that says
        whether every bucket averaged in the step was finite, or ``None`` when none was (the step errored before any
        bucket was averaged, or the hook did not run).

        Nothing is read from the device here: the flags are copied to the host and reset by work queued after the
        averaging, and the returned function reads the copy, which the commit gate does once the vote has
        synchronized the device (:mod:`lightning_ft.manager.vote_inputs`).
        """
        checked, self.checked_buckets = self.checked_buckets, 0
        if not checked:
            return None
        taken = [host_copy(flag) for flag in self._non_finite_flags.values()]
        for flag in self._non_finite_flags.values():
            flag.zero_()
        return lambda: not any(bool(flag.item()) for flag in taken)


def ft_allreduce_hook(state: FTCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group, then over participating groups: sum inside the group, sum across groups,
    and one multiplication by 1 / (group size × participants) when the cross-group sum arrives.

    Returns without waiting for the cross-group allreduce, so that it overlaps the rest of the backward pass; DDP
    waits for the future before it writes the gradients. An intra-group failure raises: the group is the unit of
    failure and is restarted whole. A cross-group failure never raises, now or in the future: the Manager records
    it (``should_commit()`` will say no), and the future completes with the bucket's (garbage) contents.
    """
    state.before_allreduce()
    if state.left_out is not None:
        state.left_out.saw(bucket)
    buffer = bucket.buffer()
    if state.group_world_size > 1:
        dist.all_reduce(buffer, group=state.group)
    averaged = cross_group_average(state, buffer, group_world_size=state.group_world_size)
    if state.step_deadline is not None and bucket.is_last():
        state.step_deadline.arm()
    return averaged


def cross_group_average(
    state: FTCommState, buffer: torch.Tensor, group_world_size: int = 1
) -> torch.futures.Future[torch.Tensor]:
    """The average of ``buffer`` over the participating groups, as a future that never fails. ``buffer`` holds the
    sum over ``group_world_size`` ranks of this group; the result is divided by those too.

    What ``Manager.allreduce`` does, without the per-call objects on the training thread that make it cost more
    than the collective on a small model (torchft's lazy ``_ManagedWork`` chain, profiler ranges, and a timer per
    call): after the step has errored nothing is sent; the quorum is awaited; a group that only heals this step
    sends zeros; the process group sums, and the completion callback averages (:meth:`FTCommState.average_in_place`,
    which also checks the result for inf and NaN). Errors go to
    the Manager (``report_error``), which then votes against the step. A hung collective fails through Gloo's own
    timeout (``FTStrategy(timeout=...)``), or on NCCL through the step's one deadline (``state.step_deadline``, armed
    by the hook after the last bucket). An allreduce that the other groups have left behind fails earlier, through
    lightning-ft's Gloo process group (:mod:`lightning_ft.process_group.left_behind`).
    """
    manager = state.manager
    if manager.errored() is not None:  # the step is lost already; its gradients are never applied
        return _completed(buffer)
    divisor = group_world_size * manager.num_participants()  # waits for the quorum, as torchft's does
    if manager.errored() is not None:  # the new quorum failed its first exchange (lightning_ft.manager.quorum_kind)
        return _completed(buffer)
    if not manager.is_participating():
        buffer.zero_()
    deadline = state.step_deadline
    try:
        if deadline is not None:
            work = deadline.allreduce([buffer], CROSS_GROUP_SUM)
        else:
            work = cross_group_process_group(manager).allreduce([buffer], CROSS_GROUP_SUM)
    except Exception as error:
        _report(manager, error)
        return _completed(buffer)
    state.collectives_launched += 1

    def average(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            done.value()
        except Exception as error:
            _report(manager, error)
            return buffer
        state.average_in_place(buffer, divisor)
        return buffer

    averaged = work.get_future().then(average)
    if deadline is not None:
        deadline.launched(averaged)
    return averaged


def _report(manager: Manager, error: Exception) -> None:
    """A cross-group collective failed: the step will not commit. Logged once per step (the first error wins)."""
    if manager.errored() is None:
        log.warning("lightning-ft: a cross-group allreduce failed; this step will not commit: %s", error)
    manager.report_error(error)


def _completed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def install_ddp_cross_group_hook(
    model: DistributedDataParallel, manager: Manager, protocol: StepProtocol, group_size: int, several_groups: bool
) -> FTCommState:
    """Register :func:`ft_allreduce_hook` on the group's DDP wrapper; returns its state.

    In a job of several groups without the unused-parameter search, the bucket layout is pinned first
    (:func:`pin_bucket_layout`); one group has no other group's layout to match and keeps DDP's own.

    Gloo's own timeout bounds a hung allreduce (and lightning-ft's Gloo process group gives up one that the other
    members have left behind: :mod:`lightning_ft.process_group.left_behind`); on NCCL one deadline per step does
    (:class:`~lightning_ft.process_group.step_deadline.StepDeadline`), and on a CUDA device the protocol's vote
    waits for the end of the backward pass only (its ``vote_fence``, :mod:`lightning_ft.manager.vote_fence`).
    """
    over_nccl = not crosses_groups_over_gloo(manager)
    device = next(model.parameters()).device
    state = FTCommState(
        manager=manager,
        group=None,
        group_world_size=group_size,
        before_allreduce=protocol.before_cross_group_allreduce,
        step_deadline=_step_deadline(manager) if over_nccl else None,
        vote_fence=VoteFence(device) if over_nccl and device.type == "cuda" else None,
        ddp=weakref.ref(model),
        left_out=LeftOutParameters(model),
    )
    model.register_comm_hook(state, ft_allreduce_hook)
    protocol.vote_fence = state.vote_fence
    if several_groups and not model.find_unused_parameters:
        pin_bucket_layout(model)
    return state


def _step_deadline(manager: Manager) -> StepDeadline:
    process_group = cross_group_process_group(manager)
    return StepDeadline(process_group, process_group_timeout(process_group))


def pin_bucket_layout(model: DistributedDataParallel) -> None:
    """Fix DDP's gradient buckets now, from the model alone, so that they line up in every group at every step.

    Without the unused-parameter search, DDP starts with a single bucket and rebuilds its buckets once, before a
    process's second forward pass, in the order its first backward pass made the gradients ready. A group restarted
    mid-run would then take its first step with that single bucket against its peers' rebuilt ones: the cross-group
    allreduce would add up different parameters' gradients. Rebuilding here, before any step, from every parameter in
    registration order (what torch's own ``Join`` hook does for a rank that ran out of data) gives every group the
    same layout, and DDP never rebuilds again. The price is the order: the buckets follow the forward pass, DDP
    launches them in that order, so the first bucket (the first layers' gradients, ready last) holds every allreduce
    back to the end of the backward pass. With ``find_unused_parameters=True`` (the default) DDP never rebuilds, its
    first layout already runs backwards, and the allreduces overlap the backward pass, at the cost of a graph
    traversal every step (``docs/benchmarks.md``).
    """
    if not rebuild_ddp_buckets(model.reducer):
        raise UnsupportedModelError(
            "DDP did not rebuild its gradient buckets before the first step; FTStrategy needs it to"
        )

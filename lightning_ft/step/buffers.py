"""Buffers across replica groups: at every vote, the change of every buffer since the job last agreed on it is
averaged over every participating process, so every replica holds bit-identical buffers at every committed step.

Parameters change only through the optimizer, on a gradient that every replica shares. Buffers change elsewhere: in
the forward pass (BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked``), from each replica's own
batch, or in user code. Plain DDP keeps the ranks of one job together with ``broadcast_buffers=True``: rank 0's
buffers overwrite everyone's at every forward pass. Inside a replica group that still happens (it is torch's DDP).
Across groups, FTStrategy's equivalent, ``buffer_sync="average"`` (the default), is:

    committed buffers + the mean, over every process of every participating group, of
    (its buffers at the vote - the committed buffers)

Why an average of changes, not a broadcast from one participant:

* No participant is special. A broadcast needs a source that every group agrees on, and a source that dies in the
  step takes the step's statistics with it; the average needs nothing but the step's quorum.
* It loses no replica's statistics. BatchNorm's running statistics are an exponential moving average, linear in the
  batch's statistic, so the average of the groups' updates is the update by the average of their batch statistics:
  what each replica would hold had it seen the whole job's batch means (SyncBatchNorm normalises with those too;
  this keeps the per-replica normalisation of plain DDP and makes only the running statistics job-wide).
* Changes, not values: a buffer that nobody changed (a constant, a cache) stays exactly as it is, and integer
  counters (``num_batches_tracked``) stay exact. The sum runs in float64, so n equal changes of a float32 buffer
  average to exactly that change, and the result is then rounded to the buffer's dtype once.

What "the committed buffers" are: the buffers as the job last agreed on them, at the last committed vote (or this
process's first step, or its heal). Everything that changed a buffer since (the step's forward passes, a forward
after the vote in manual optimization, a callback) is part of the next vote's change.

A step that does not commit returns every buffer to the committed buffers, as it leaves the parameters untouched
(with a semi-synchronous algorithm a sync that does not commit leaves buffers as they are, as it leaves the local
parameters). A group that heals receives the committed buffers, never the ones its peer's forward pass is changing
while it sends (see :meth:`ModelBuffers.committed_state`); a group that does not take part in a step (it heals, or
it is a spare) contributes no change and receives the average. Buffers that are neither floating point nor integer
(``bool``, complex) are left to each replica.

When: with automatic optimization the buffers are read, and their allreduce starts, when the step's backward pass
hands its first gradient to the cross-group hook (every forward pass of the step is done by then), so the allreduce
overlaps the rest of the backward pass; the vote waits for it. Without a gradient hook (no gradients, a
semi-synchronous sync) it runs at the vote. A change after that point (a callback's, after the vote) is not lost: it
is part of the next vote's change. With manual optimization, where a forward pass may follow the first optimizer's
step (a GAN's second player), the average is taken at the end of the batch instead, after the vote, in every group of
the quorum; a failure there, after a positive decision, stops the group so that it heals, as the later optimizers'
gradient allreduces of such a batch already do.

The cost per step: a handful of fused operations over one flat float64 copy of the buffers and one allreduce of
their size, overlapped with the backward pass (``docs/benchmarks.md``). Nothing at all for a model without buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torchft import Manager

from lightning_ft.errors import UnsupportedModelError
from lightning_ft.manager.internals import CROSS_GROUP_SUM, cross_group_process_group, crosses_groups_over_gloo
from lightning_ft.torch_internals import fused_copy

log = logging.getLogger("lightning.pytorch.lightning_ft")


def synced_buffers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """The buffers that are averaged: ``(qualified name, owning module, attribute)`` for every floating-point or
    integer buffer, in ``named_buffers()`` order (the same in every replica of the same model)."""
    found = []
    for module_name, owner in module.named_modules(remove_duplicate=True):
        for attribute, buffer in owner.named_buffers(recurse=False):
            if buffer is None or buffer.dtype == torch.bool or buffer.is_complex():
                continue
            found.append((f"{module_name}.{attribute}" if module_name else attribute, owner, attribute))
    return found


class ModelBuffers:
    """The committed buffers of one process's model, and the average of their changes at each vote.

    The committed buffers are held as one flat float64 tensor (exact for every float32, float16, bfloat16 and integer
    value below 2**53), floating-point buffers first, so that each step's arithmetic is a few fused operations.

    Args:
        module: The LightningModule (its buffers are read by owner and attribute at every step: a buffer reassigned in
            the forward pass is followed).
        manager: The group's torchft Manager, for the cross-group sum and the step's participants.
        group_size: The processes of this replica group; with more than one, the changes are summed inside the group
            first (``group_sum``, the group's default process group), so that every process of the job ends the step
            with the same buffers.
        restore_on_reject: Return to the committed buffers when a vote does not commit (per-step training); ``False``
            for the syncs of a semi-synchronous algorithm, which leave local state alone.
        at_batch_end: Average at the end of the batch, after its vote (manual optimization: a forward pass may follow
            the first optimizer's step, and its change belongs to the same committed step); else before the vote.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        manager: Manager,
        group_size: int = 1,
        restore_on_reject: bool = True,
        group_sum: Callable[[Tensor], None] | None = None,
        at_batch_end: bool = False,
    ) -> None:
        self.module = module
        self.at_batch_end = at_batch_end
        self.manager = manager
        self.group_size = group_size
        self.restore_on_reject = restore_on_reject
        self._group_sum = group_sum or (lambda tensor: dist.all_reduce(tensor))
        self._located: list[tuple[str, torch.nn.Module, str]] | None = None
        self._layout: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self._integers = 0  # where the integer buffers start in the flat tensors
        self._committed: Tensor | None = None  # flat float64: the buffers as the job last agreed on them
        self._captured: Tensor | None = None  # flat float64: the buffers when this step's average started
        self._changes: Tensor | None = None  # captured - committed, summed over the job once the allreduce is done
        self._pending: torch.futures.Future | None = None
        self._divisor = 1
        self._averaged = False
        self._started = False  # this step's average has started (the buffers were read into _captured)
        self._healed_since_capture = False
        self._late: Tensor | None = None  # flat float64 scratch: what changed after the average started
        self._view_cache: dict[int, tuple[Tensor, list[Tensor]]] = {}

    # ------------------------------------------------------------------ reading the model
    def _locate(self) -> list[tuple[str, torch.nn.Module, str]]:
        """The averaged buffers, floating point first (the integer ones are floored after the average)."""
        if self._located is None:
            found = synced_buffers(self.module)

            def kind(entry: tuple[str, torch.nn.Module, str]) -> tuple[bool, str]:
                buffer = getattr(entry[1], entry[2])
                return not buffer.is_floating_point(), str(buffer.dtype)

            self._located = sorted(found, key=kind)  # stable: named_buffers() order within a dtype
            floating = [entry for entry in self._located if not kind(entry)[0]]
            self._integers = sum(getattr(owner, attribute).numel() for _, owner, attribute in floating)
        return self._located

    def _buffers(self) -> list[Tensor]:
        return [getattr(owner, attribute).detach() for _, owner, attribute in self._locate()]

    @property
    def names(self) -> list[str]:
        """The qualified names of the averaged buffers, in the order of the flat tensors."""
        return [name for name, _, _ in self._locate()]

    def _views(self, flat: Tensor) -> list[Tensor]:
        """One view of ``flat`` per buffer (computed once per flat tensor kept)."""
        cached = self._view_cache.get(id(flat))
        if cached is not None and cached[0] is flat:
            return cached[1]
        views, offset = [], 0
        for shape, _, _ in self._layout:
            numel = shape.numel()
            views.append(flat[offset : offset + numel].view(shape))
            offset += numel
        if any(flat is kept for kept in (self._committed, self._captured, self._late)):
            self._view_cache[id(flat)] = (flat, views)
        return views

    def _check_layout(self, buffers: list[Tensor]) -> None:
        if [(b.shape, b.dtype, b.device) for b in buffers] != self._layout:
            raise UnsupportedModelError(
                f"lightning-ft: the model's buffers changed shape, dtype or device during training "
                f"({', '.join(self.names)}); buffer_sync='average' needs them fixed. Create buffers at their final "
                f"shape in __init__, or set FTStrategy(buffer_sync='off')."
            )

    def _read(self, buffers: list[Tensor], into: Tensor) -> None:
        """Copy ``buffers`` into the flat float64 ``into`` (one fused copy)."""
        fused_copy(self._views(into), buffers)

    def _write(self, flat: Tensor, buffers: list[Tensor]) -> None:
        """Copy the flat float64 ``flat`` into ``buffers``, rounding to each buffer's dtype once (one fused copy)."""
        fused_copy(buffers, self._views(flat))

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """Take the committed buffers from the model if none are held yet (this process's first step). Called before
        the step's quorum starts: a peer that heals from this group in that quorum is sent these."""
        if self._committed is None:
            self.adopt()

    def adopt(self) -> None:
        """The model's buffers are the job's committed buffers now (a heal just loaded them). A step's average taken
        before the heal still applies: with an asynchronous quorum the heal comes inside the vote, after it."""
        self._located = None  # the heal may have loaded a module whose buffers were reassigned
        buffers = self._buffers()
        self._layout = [(b.shape, b.dtype, b.device) for b in buffers]
        if not buffers:
            self._committed = torch.empty(0, dtype=torch.float64)
            return
        total = sum(b.numel() for b in buffers)
        if self._committed is None or self._committed.numel() != total:
            self._view_cache.clear()
            self._committed = torch.empty(total, dtype=torch.float64, device=buffers[0].device)
            self._late = torch.empty_like(self._committed)
            self._captured = None
        self._read(buffers, self._committed)
        self._healed_since_capture = self._started

    def start_average(self) -> None:
        """Read the buffers and start summing their change over the job, once per step: at the backward pass's first
        cross-group gradient (every forward pass of the step is done), or at the vote. Nothing raises for a
        cross-group failure: it is reported to the Manager, so the vote says no."""
        committed = self._committed
        if committed is None or not committed.numel() or self._started:
            return
        manager = self.manager
        if manager.errored() is not None:  # the step is lost already
            return
        self._started = True
        if self._captured is None or self._captured.numel() != committed.numel():
            self._captured = torch.empty_like(committed)
        buffers = self._buffers()
        self._check_layout(buffers)
        self._read(buffers, self._captured)
        # A new tensor each step: a failed allreduce may still be writing the previous one.
        changes = self._changes = torch.sub(self._captured, committed)
        if self.group_size > 1:  # the group is the unit of failure: an error here stops it, as in DDP
            self._group_sum(changes)
        self._divisor = self.group_size * manager.num_participants()  # waits for the quorum
        if manager.errored() is not None:  # the new quorum failed its first exchange (lightning_ft.manager.quorum_kind)
            return
        if not manager.is_participating():  # healing or a spare: it receives the average, it adds nothing
            changes.zero_()
        try:
            future = cross_group_process_group(manager).allreduce([changes], CROSS_GROUP_SUM).get_future()
            if not crosses_groups_over_gloo(manager):  # Gloo's own timeout bounds it; others get the Manager's
                future = manager.wrap_future(future, default=None)
            self._pending = future
        except Exception as error:
            _report(manager, error)

    def average(self) -> None:
        """Before the vote: start the average if the backward pass did not, and wait for it."""
        self.start_average()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception as error:
            _report(self.manager, error)
            return
        if self.manager.errored() is None and self._changes is not None:
            self._changes.div_(self._divisor)
            self._changes[self._integers :].floor_()  # the same integer everywhere (exact when the changes agree)
            self._averaged = True

    def settle(self, committed: bool) -> None:
        """After the vote: a committed step sets the committed buffers to committed + mean change, and the model's
        buffers to that plus whatever this replica changed after the average started (a forward pass after it, in
        manual optimization; nothing after a heal, which replaced them); a step that did not commit returns to the
        committed buffers (``restore_on_reject``)."""
        averaged, started, changes = self._averaged, self._started, self._changes
        healed, self._healed_since_capture = self._healed_since_capture, False
        self._averaged, self._started, self._changes, self._pending = False, False, None, None
        if self._committed is None or not self._committed.numel():
            return
        buffers = self._buffers()
        if committed and averaged and started and changes is not None:
            late = self._late if not healed else None
            if late is not None and self._captured is not None:
                self._read(buffers, late)
                late.sub_(self._captured)
            self._committed.add_(changes)
            # Round once to the buffers' dtypes and keep exactly that: a group that heals from this one adopts what
            # the buffers hold, and the next step's changes must be taken from the same values in every group.
            self._write(self._committed, buffers)
            self._read(buffers, self._committed)
            if late is not None:
                self._write(late.add_(self._committed), buffers)
        elif not committed and self.restore_on_reject:
            self._write(self._committed, buffers)

    def committed_state(self) -> dict[str, Tensor]:
        """The committed buffers by state-dict name, in their own dtypes (the caller keeps those its state holds):
        what a healing peer receives instead of buffers that this process's forward pass may be changing."""
        if self._committed is None or not self._committed.numel():
            return {}
        views = self._views(self._committed)
        return {name: view.to(dtype) for name, view, (_, dtype, _) in zip(self.names, views, self._layout, strict=True)}


def _report(manager: Manager, error: Exception) -> None:
    if manager.errored() is None:
        log.warning("lightning-ft: the cross-group buffer average failed; this step will not commit: %s", error)
    manager.report_error(error)

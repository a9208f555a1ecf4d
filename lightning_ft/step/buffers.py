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

The cost per step: two copies of the buffers, one float64 allreduce of their size before the vote
(``docs/benchmarks.md``). Nothing at all for a model without buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import AllreduceOptions, ReduceOp
from torchft import Manager

from lightning_ft.manager.internals import cross_group_process_group, crosses_groups_over_gloo

log = logging.getLogger("lightning.pytorch.lightning_ft")

_SUM = AllreduceOptions()
_SUM.reduceOp = ReduceOp.SUM


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

    Args:
        module: The LightningModule (its buffers are read by name at every step: a buffer reassigned in the forward
            pass is followed).
        manager: The group's torchft Manager, for the cross-group sum and the step's participants.
        group_size: The processes of this replica group; with more than one, the changes are summed inside the group
            first (on the group's default process group), so that every process of the job ends the step with the
            same buffers.
        restore_on_reject: Return to the committed buffers when a vote does not commit (per-step training); ``False``
            for the syncs of a semi-synchronous algorithm, which leave local state alone.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        manager: Manager,
        group_size: int = 1,
        restore_on_reject: bool = True,
        group_sum: Callable[[Tensor], None] | None = None,
    ) -> None:
        self.module = module
        self.manager = manager
        self.group_size = group_size
        self.restore_on_reject = restore_on_reject
        self._group_sum = group_sum or (lambda tensor: dist.all_reduce(tensor))
        self._located: list[tuple[str, torch.nn.Module, str]] | None = None
        self._committed: list[Tensor] | None = None
        self._averaged: Tensor | None = None

    # ------------------------------------------------------------------ reading the model
    def _buffers(self) -> list[Tensor]:
        if self._located is None:
            self._located = synced_buffers(self.module)
        buffers = [getattr(owner, attribute) for _, owner, attribute in self._located]
        return [buffer.detach() for buffer in buffers]

    @property
    def names(self) -> list[str]:
        """The qualified names of the averaged buffers."""
        if self._located is None:
            self._located = synced_buffers(self.module)
        return [name for name, _, _ in self._located]

    def _matches(self, buffers: list[Tensor]) -> bool:
        committed = self._committed
        return committed is not None and all(
            b.shape == c.shape and b.dtype == c.dtype and b.device == c.device
            for b, c in zip(buffers, committed, strict=True)
        )

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """Take the committed buffers from the model if none are held yet (this process's first step). Called before
        the step's quorum starts: a peer that heals from this group in that quorum is sent these."""
        if self._committed is not None:
            return
        buffers = self._buffers()
        self._committed = [buffer.clone() for buffer in buffers] if buffers else []

    def adopt(self) -> None:
        """The model's buffers are the job's committed buffers now (a heal just loaded them). A step's average taken
        before the heal still applies: with an asynchronous quorum the heal comes inside the vote, after it."""
        self._located = None  # the heal may have loaded a module whose buffers were reassigned
        buffers = self._buffers()
        if not buffers:
            self._committed = []
        elif self._committed is not None and self._matches(buffers):
            torch._foreach_copy_(self._committed, buffers)
        else:
            self._committed = [buffer.clone() for buffer in buffers]

    def average(self) -> None:
        """Before the vote: the job-wide mean change since the committed buffers. A failure is reported to the
        Manager, so the vote says no; nothing raises."""
        self._averaged = None
        if not self._committed:
            return
        manager = self.manager
        if manager.errored() is not None:  # the step is lost already
            return
        buffers = self._buffers()
        if not self._matches(buffers):
            raise RuntimeError(
                f"lightning-ft: the model's buffers changed shape, dtype or device during training "
                f"({', '.join(self.names)}); buffer_sync='average' needs them fixed. Create buffers at their final "
                f"shape in __init__, or set FTStrategy(buffer_sync='off')."
            )
        pairs = zip(buffers, self._committed, strict=True)
        changes = torch.cat([(b.to(torch.float64) - c.to(torch.float64)).reshape(-1) for b, c in pairs])
        if self.group_size > 1:  # the group is the unit of failure: an error here stops it, as in DDP
            self._group_sum(changes)
        divisor = self.group_size * manager.num_participants()  # waits for the quorum
        if not manager.is_participating():  # healing or a spare: it receives the average, it adds nothing
            changes.zero_()
        try:
            work = cross_group_process_group(manager).allreduce([changes], _SUM)
            future = work.get_future()
            if not crosses_groups_over_gloo(manager):  # Gloo's own timeout bounds it; others get the Manager's
                future = manager.wrap_future(future, default=None)
            future.wait()
        except Exception as error:
            if manager.errored() is None:
                log.warning("lightning-ft: the cross-group buffer average failed; this step will not commit: %s", error)
            manager.report_error(error)
            return
        if manager.errored() is None:
            self._averaged = changes.div_(divisor)

    def settle(self, committed: bool) -> None:
        """After the vote: a committed step sets every buffer to committed + mean change, and that becomes the
        committed buffers; a step that did not commit returns to the committed buffers (``restore_on_reject``)."""
        averaged, self._averaged = self._averaged, None
        if not self._committed:
            return
        buffers = self._buffers()
        if committed and averaged is not None:
            offset = 0
            for buffer, before in zip(buffers, self._committed, strict=True):
                change = averaged[offset : offset + buffer.numel()].view(buffer.shape)
                offset += buffer.numel()
                if not buffer.is_floating_point():
                    change = change.floor()  # the same integer in every replica (exact when the changes agree)
                buffer.copy_(before.to(torch.float64) + change)
            torch._foreach_copy_(self._committed, buffers)
        elif not committed and self.restore_on_reject:
            torch._foreach_copy_(buffers, self._committed)

    def committed_state(self) -> dict[str, Tensor]:
        """The committed buffers by state-dict name (persistent or not; the caller keeps those its state holds):
        what a healing peer receives instead of buffers that this process's forward pass may be changing."""
        if not self._committed:
            return {}
        return dict(zip(self.names, self._committed, strict=True))

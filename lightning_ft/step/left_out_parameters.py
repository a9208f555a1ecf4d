"""A parameter that a whole replica group left out of a training step's loss, with ``find_unused_parameters=True``
(FTStrategy's default): every group applies the job's average gradient to it, as every other group does.

DDP gives a parameter that some process of its process group used, and another did not, the group's average on
every process: it marks the unused one ready with zeros in its bucket, and copies the reduced bucket back into every
gradient. A parameter that *no* process of the group used, DDP leaves untouched (its gradient stays ``None``), for
it knows only its own group (``Reducer::finalize_bucket_dense``: "globally unused"). Across replica groups that is no
longer global: group A leaves the last layer's bias out of one step (a branch not taken, a layer skipped for one
batch), group B uses it; the cross-group average in A's bucket is B's gradient over two, B's optimizer applies it,
A's optimizer skips the bias, and the job holds two models from then on (the replica consistency check says so at
its next run). Measured with two groups, the bias left out by one group at one step.

The rule here, for every group alike: after each backward pass that reduced the buckets, a parameter the group left
out takes its bucket's slot, which holds the average over every participating group (zeros where no group used
it). So a parameter that every group left out gets a zero gradient, not ``None`` as under DDP alone: the optimizer
then steps it with a zero gradient (weight decay, momentum and Adam's step count apply to it), the same in every
group. Without a second collective per step no group can know that the others left it out too.

How a left-out parameter is found, without reading the device: with ``gradient_as_bucket_view=True`` (FTStrategy's
default) a used parameter's gradient is a view of its slot after the reduction, so a gradient that is ``None`` was
left out (zeroed gradients that ``zero_grad(set_to_none=False)`` kept are views of the slot already, and hold the
average). With ``gradient_as_bucket_view=False`` the gradients are copies, so DDP's own count of the group's uses is
read (``torch_internals.ddp_group_usage``; on a GPU, a device sync).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_ft.torch_internals import ddp_group_usage, ddp_reduced_parameters


class LeftOutParameters:
    """Gives the parameters a group left out of a step the job's average from their buckets (see the module).

    :meth:`saw` is called by the cross-group comm hook for every bucket, :meth:`give_average` after every backward
    pass; both cost a few attribute reads when nothing was left out.
    """

    def __init__(self, model: Any) -> None:
        # A weak reference, as FTCommState's: DDP's C++ reducer holds the hook state that holds this.
        self._model = weakref.ref(model)
        self._parameters: list[Tensor] = ddp_reduced_parameters(model)  # in the reducer's index order
        self._gradient_as_bucket_view = bool(model.gradient_as_bucket_view)
        self._buffers: dict[int, int] = {}  # bucket index -> the address of the bucket's flat buffer
        self._slots: dict[int, Tensor] = {}  # id(parameter) -> its view in the bucket's flat buffer
        self._reduced = False

    def saw(self, bucket: dist.GradBucket) -> None:
        """Record where ``bucket``'s parameters sit in its buffer (once, and again if DDP rebuilt its buckets)."""
        buffer = bucket.buffer()
        index = bucket.index()
        if self._buffers.get(index) != buffer.data_ptr():
            self._buffers[index] = buffer.data_ptr()
            for parameter, slot in zip(bucket.parameters(), bucket.gradients(), strict=True):
                self._slots[id(parameter)] = slot
        if bucket.is_last():
            self._reduced = True

    def give_average(self) -> None:
        """After a backward pass that reduced the buckets: each parameter the group left out gets its slot's
        average (a view of the slot with ``gradient_as_bucket_view``, a copy otherwise). A backward pass that
        reduced nothing (gradient accumulation's ``no_sync``) leaves every gradient as it is."""
        if not self._reduced:
            return
        self._reduced = False
        for parameter in self._left_out():
            slot = self._slots[id(parameter)]
            if self._gradient_as_bucket_view:
                parameter.grad = slot
            elif parameter.grad is None:
                parameter.grad = slot.clone()
            else:
                parameter.grad.copy_(slot)

    def _left_out(self) -> list[Tensor]:
        if self._gradient_as_bucket_view:
            return [parameter for parameter in self._parameters if parameter.grad is None]
        model = self._model()
        if model is None:
            return []
        usage = ddp_group_usage(model)
        if bool(usage.all()):
            return []
        return [self._parameters[index] for index in usage.eq(0).nonzero().flatten().tolist()]

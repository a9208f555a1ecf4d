"""A parameter that a replica group left out of a training step's loss (a branch not taken, a layer skipped for one
batch, an expert no sample reached): every group applies the job's average gradient to it, as to any other.

The rule, for every group alike: a parameter that some group used gets the average over the participating groups,
in which a group that left it out counts zeros (as DDP counts a process that left it out); a parameter that no group
used gets a zero gradient in every group, so the optimizer steps it alike everywhere (weight decay, momentum and
Adam's step count apply to it; under DDP alone its gradient would stay ``None``). Without a second collective per
step no group can know that the others left it out too. A parameter frozen now (``requires_grad=False``: a frozen
backbone, the other player of a toggled optimizer) is used by no group and keeps its gradient as it was, as under
DDP.

How, by FTStrategy's ``find_unused_parameters`` (:func:`search_for_unused_parameters` chooses for ``None``):

* Without DDP's search (``None`` on a model whose gradients make one bucket): DDP waits for every parameter of a
  bucket before it reduces it, so a left-out parameter holds its bucket back. After the backward pass,
  :class:`LeftOutParameters` asks DDP which parameters it still waits for and runs a second backward pass through
  them alone, with zero gradients (``(p.sum() * 0).backward()``: DDP's hook on each one fires, the bucket crosses
  groups, and DDP writes the average back into every gradient). The search costs a traversal of the autograd graph,
  a Python autograd function and an allreduce of DDP's usage map in every step (0.6 to 0.7 ms of a 16-ms step on
  a 0.3 M MLP, ``docs/benchmarks.md``); this costs one flag read per step, and a small backward pass in a step that
  leaves something out. With one bucket, the search buys no overlap of the allreduce with the backward pass.
* With the search (``True``, or ``None`` on a model of several buckets, where the backward order of the buckets
  lets their allreduces overlap the backward pass): DDP marks a left-out parameter ready with zeros in its bucket,
  and copies the reduced bucket back into every gradient, except a parameter that no process of *its* process group
  used: that one it leaves untouched, for DDP knows only its own group ("globally unused",
  ``Reducer::finalize_bucket_dense``). Across replica groups that is not global: the group that used the parameter
  applies the average, the group that left it out skips it, and the job holds two models (measured: two groups, the
  bias left out by one at one step, the replica consistency check stopped the job). So after the backward pass each
  such parameter takes its bucket's slot, which holds the average. It is found without reading the device: with
  ``gradient_as_bucket_view=True`` (FTStrategy's default) a used parameter's gradient is a view of its slot after the
  reduction, so one that is ``None`` was left out (zeroed gradients that ``zero_grad(set_to_none=False)`` kept are
  views of the slot already); with ``False`` DDP's count of the group's uses is read (on a GPU, a device sync).

A user's ``False`` takes the first way, ``True`` the second: the setting chooses how, never whether, a step may leave a
parameter out. Semi-synchronous training (LocalSGD, DiLoCo) has no cross-group hook: its inner steps are DDP's own,
which needs the search for such a step (``None`` chooses it there). Should DDP name no parameter it waits for, the
check before the vote stops the group instead (:mod:`lightning_ft.step.unfinished_reduction`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_ft.step.unfinished_reduction import unreduced_indices
from lightning_ft.torch_internals import ddp_group_usage, ddp_reduced_parameters, ddp_reduction_pending

_MIB = 1024 * 1024


def search_for_unused_parameters(
    model: Module, ddp_kwargs: Mapping[str, Any], *, chosen_by_default: bool, per_step: bool
) -> bool:
    """The ``find_unused_parameters`` DDP gets for ``model``. A user's own value wins. FTStrategy's default (``None``)
    searches only where the search buys something: not on a model whose trainable gradients make one bucket (one
    dtype, one device, dense, at most ``bucket_cap_mb``) in per-step training, where :class:`LeftOutParameters`
    completes a step that leaves parameters out; semi-synchronous inner steps are DDP's alone, which needs the
    search for such a step."""
    if not chosen_by_default:
        return bool(ddp_kwargs["find_unused_parameters"])
    return not (per_step and _one_bucket(model, ddp_kwargs["bucket_cap_mb"]))


def _one_bucket(model: Module, bucket_cap_mb: float) -> bool:
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    sparse = any(
        isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse for module in model.modules()
    )
    kinds = {(parameter.dtype, parameter.device) for parameter in trainable}
    size = sum(parameter.numel() * parameter.element_size() for parameter in trainable)
    return not sparse and len(kinds) == 1 and size <= bucket_cap_mb * _MIB


class LeftOutParameters:
    """Gives the parameters a group left out of a step the job's average (see the module), for DDP ``model``.

    :meth:`saw` is called by the cross-group comm hook for every bucket, :meth:`give_average` after every backward
    pass; both cost a few attribute reads when nothing was left out.
    """

    def __init__(self, model: Any) -> None:
        # A weak reference, as FTCommState's: DDP's C++ reducer holds the hook state that holds this.
        self._model = weakref.ref(model)
        self._parameters: list[Tensor] = ddp_reduced_parameters(model)  # in the reducer's index order
        self._searched = bool(model.find_unused_parameters)
        self._gradient_as_bucket_view = bool(model.gradient_as_bucket_view)
        self._buffers: dict[int, int] = {}  # bucket index -> the address of the bucket's flat buffer
        self._slots: dict[int, Tensor] = {}  # id(parameter) -> its view in the bucket's flat buffer
        self._reduced = False

    def saw(self, bucket: dist.GradBucket) -> None:
        """Record where ``bucket``'s parameters sit in its buffer (once, and again if DDP rebuilt its buckets)."""
        if not self._searched:
            return
        buffer = bucket.buffer()
        index = bucket.index()
        if self._buffers.get(index) != buffer.data_ptr():
            self._buffers[index] = buffer.data_ptr()
            for parameter, slot in zip(bucket.parameters(), bucket.gradients(), strict=True):
                self._slots[id(parameter)] = slot
        if bucket.is_last():
            self._reduced = True

    def give_average(self) -> None:
        """After a backward pass: complete DDP's reduction of the parameters it waits for (without the search), or
        give each parameter the group left out its slot's average (with it). A backward pass that reduced nothing
        (gradient accumulation's ``no_sync``) leaves every gradient as it is."""
        if not self._searched:
            self._complete_the_reduction()
            return
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

    def _complete_the_reduction(self) -> None:
        model = self._model()
        pending = ddp_reduction_pending(model) if model is not None else None
        indices = unreduced_indices(pending) if pending is not None else None
        if not indices:  # nothing pending; or DDP named nothing, and the check before the vote stops the group
            return
        waited_for = [self._parameters[index] for index in indices]
        # A parameter frozen since DDP wrapped the model (requires_grad=False: a frozen backbone, the other player of
        # a toggled optimizer) is reduced like the others, then left as it was, as DDP's search leaves it.
        frozen = {id(parameter): parameter.grad for parameter in waited_for if not parameter.requires_grad}
        with torch.enable_grad():
            for parameter in waited_for:
                parameter.requires_grad_(True)
            try:
                torch.autograd.backward([parameter.sum() * 0 for parameter in waited_for])
            finally:
                for parameter in waited_for:
                    if id(parameter) in frozen:
                        parameter.requires_grad_(False)
                        parameter.grad = frozen[id(parameter)]

    def _left_out(self) -> list[Tensor]:
        """The parameters this group left out, except frozen ones (``requires_grad=False`` now), which stay as
        DDP left them in every group alike."""
        if self._gradient_as_bucket_view:
            return [parameter for parameter in self._parameters if parameter.grad is None and parameter.requires_grad]
        model = self._model()
        if model is None:
            return []
        usage = ddp_group_usage(model)
        if bool(usage.all()):
            return []
        left_out = (self._parameters[index] for index in usage.eq(0).nonzero().flatten().tolist())
        return [parameter for parameter in left_out if parameter.requires_grad]

"""A step whose backward pass left gradients out of DDP's reduction is never committed, and DDP's own complaint about
it names FTStrategy's setting.

Without DDP's search (``find_unused_parameters=False``, FTStrategy's choice for a model of one bucket) DDP reduces a
gradient bucket once every parameter in it has its gradient, and launches the buckets in order. A training step
whose loss leaves a parameter out leaves that bucket, and every bucket after it, unreduced: the communication hook
never runs for them, so their gradients cross neither the group nor the replica groups. DDP only says so at the
next forward pass ("Expected to have finished reduction in the prior iteration"), after the optimizer has stepped:
each group would have applied its own gradients and committed the step, and the job would hold one model per group.

In per-step training :mod:`lightning_ft.step.left_out_parameters` completes such a reduction right after the backward
pass, from the parameters DDP names (:func:`unreduced_indices`). The step owner still asks DDP before the vote and
before every later optimizer of the same step (:func:`check_reduction_finished`): should a reduction remain
unfinished (DDP named no parameter), :class:`UnusedParameterError` is raised in this process before it votes: its
group does not commit the step, and stops. Another group that used every parameter sends the bucket this group never
sends; that collective fails when this process exits, or at ``timeout``, and that group does not commit the step
either (it may go on without this group).

:func:`reword_ddp_reduction_error` is for the paths that do not vote per step (LocalSGD's and DiLoCo's inner steps,
the group's own, which nothing completes): DDP's error at the next forward pass, which Lightning's ``DDPStrategy``
rewords to name its own setting, names FTStrategy's instead.
"""

from __future__ import annotations

import re
from typing import Any

from lightning_ft.errors import UnsupportedModelError
from lightning_ft.torch_internals import ddp_reduced_parameters, ddp_reduction_pending

FIX = (
    "FTStrategy(find_unused_parameters=False) needs every parameter of the LightningModule in every loss whose "
    "backward pass FTStrategy does not see (a LocalSGD or DiLoCo inner step; loss.backward() called directly instead "
    "of self.manual_backward(loss)): leave find_unused_parameters at its default (None) or set it to True for a model "
    "that leaves some out, call self.manual_backward, or make the loss use them all."
)

# DDP's message (torch/csrc/distributed/c10d/reducer.cpp, ensure_prior_reduction_finished); the pattern Lightning's
# DDPStrategy.on_exception matches too, so no message of ours quotes it.
_DDP_MESSAGE = re.compile(r".*Expected to have finished reduction in the prior iteration.*", re.DOTALL)
# The line of DDP's message that lists the parameters, by their index among the parameters DDP reduces.
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


class UnusedParameterError(UnsupportedModelError):
    """A training step's backward pass left a parameter without a gradient while DDP expected one for each
    (``find_unused_parameters=False``): the step is not committed, and the group stops. The message names the fix."""


def check_reduction_finished(model: Any) -> None:
    """Raise :class:`UnusedParameterError` if DDP ``model``'s latest backward pass left gradient buckets unreduced.

    Cheap (one flag read under the reducer's lock): called once per optimizer of every step.
    """
    pending = ddp_reduction_pending(model)
    if pending is not None:
        raise UnusedParameterError(
            "lightning-ft: a parameter got no gradient in this training step's backward pass"
            f"{_named(model, pending)}, so DDP never averaged the gradients of its bucket, across the group or across "
            f"the replica groups; this step is not committed, and this group stops. {FIX}"
        )


def unreduced_indices(ddp_message: str) -> list[int] | None:
    """The indices (in DDP's reducer order) of the parameters DDP's unfinished-reduction message lists; ``None`` if it
    lists none."""
    listed = _DDP_INDICES.search(ddp_message)
    return None if listed is None else [int(index) for index in listed.group(1).split()]


def _named(model: Any, ddp_message: str) -> str:
    """`` (net.2.bias)``: the parameters DDP's message lists by index (its reducer's index order), named; empty if it
    lists none."""
    indices = unreduced_indices(ddp_message)
    if indices is None:
        return ""
    names = {id(parameter): name for name, parameter in model.module.named_parameters()}
    reduced = [names.get(id(parameter), "?") for parameter in ddp_reduced_parameters(model)]
    return f" ({', '.join(reduced[index] if index < len(reduced) else f'index {index}' for index in indices)})"


def reword_ddp_reduction_error(exception: BaseException) -> None:
    """Replace DDP's "Expected to have finished reduction" message in ``exception`` by one that names FTStrategy's
    setting (``FTStrategy.on_exception``); any other exception is left as it is."""
    exception.args = tuple(
        (
            "lightning-ft: a parameter got no gradient in the previous training step's backward pass, so DDP did "
            f"not finish reducing its gradients before this forward pass. {FIX}"
        )
        if isinstance(arg, str) and _DDP_MESSAGE.match(arg)
        else arg
        for arg in exception.args
    )

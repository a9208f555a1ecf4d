"""LocalSGD's sync: average the parameters of every participating replica group, keep them only if the sync commits.

This is torchft's ``LocalSGD.sync()`` (``torchft/local_sgd.py``) with one difference: the quorum and the commit vote
are the sync owner's (:class:`~lightning_ft.algorithms.sync_owner.SyncOwner`), through lightning-ft's
:class:`~lightning_ft.step.protocol.StepProtocol`, instead of calls on the Manager,
so that the rest of lightning-ft (cross-group collectives, the data position, the checkpoint writer) knows a sync is in
progress and how it ended. torchft's class cannot be reused as is: it triggers itself from an optimizer post-hook
with an inner-step counter that is not part of any state dict, so a restarted group would sync at other steps than
its peers (see ``docs/semi-sync.md``). Its tensor helper is reused, so DTensor parameters work the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchft import Manager
from torchft.local_sgd import extract_local_tensor


def average_parameters(manager: Manager, params: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``params`` averaged over the participating groups. All allreduces are issued before any wait, in
    parameter order, which every group shares."""
    averaged = [extract_local_tensor(p.data) for p in params]
    works = [manager.allreduce(t) for t in averaged]
    for work in works:
        work.wait()
    return averaged


@torch.no_grad()
def take_parameters(params: Iterable[Tensor], values: Iterable[Tensor]) -> None:
    """Copy ``values`` (from :func:`average_parameters`) into ``params``: a committed sync's result."""
    for param, value in zip(params, values, strict=True):
        if isinstance(param, DTensor):
            param.data.copy_(
                DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
            )
        else:
            param.data.copy_(value)

"""HSDP's cross-group average: each ``fully_shard`` module's gradient shards cross groups as one collective, in an
order fixed at setup that every group shares, whatever a step left out.

Why not FSDP2's all-reduce hook alone (torchft's HSDP pattern, and lightning-ft's before): FSDP2 reduces a module's
gradients when the backward pass reaches it, and not at all when the group gave none of its parameters a gradient.
A group that leaves a whole module out of a step (an expert no sample reached, a branch not taken) then makes
another sequence of cross-group collectives than the groups that used it, and collectives pair up by order: Gloo
aborted the group whose sizes did not match (measured, ``docs/failure-semantics.md``), and modules of equal size
would have averaged one module's gradients with another's. Here:

* The order is fixed from the model: the ``fully_shard`` modules in reverse registration order (children before
  their parents, the last layer first, as a backward pass usually reaches them), the same in every group, restarted
  ones included. A module's own parameters are those no ``fully_shard`` module inside it holds, as FSDP2 assigns them.
* FSDP2's all-reduce hook, one per module, only says that the module is being reduced now; FSDP2 has written its
  shards to the parameters' ``.grad`` once it calls the next hook or the backward pass ends. Then every module that is
  ready crosses, in the fixed order: one reached out of order waits for those before it, so in the usual order the
  cross-group work still overlaps the rest of the backward pass.
* After the backward pass, the modules (and single parameters) this group left out get a zero gradient and cross
  too: a parameter some group used gets the average over the participating groups, a group that left it out
  counting zeros, as DDP counts a process; one that no group used ends with a zero gradient in every group; a
  parameter frozen now (``requires_grad=False``) stays as it was. The rule of
  :mod:`lightning_ft.step.left_out_parameters`, for DDP.
* A backward pass that reduced nothing (an accumulation micro-batch, FSDP2's gradient sync off) crosses nothing.

The shards cross in the gradients' dtype (after FSDP2's cast back from a ``reduce_dtype``) on the strategy's device
(CPU-offloaded gradients are copied there and back). A cross-group failure never raises: ``Manager.allreduce``
records it and the step does not commit, as with DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchft import Manager

from lightning_ft.hsdp.sharding import fsdp_modules


def modules_in_order(root: nn.Module) -> list[tuple[FSDPModule, list[nn.Parameter]]]:
    """The ``fully_shard`` modules under ``root`` in the order their shards cross groups, each with its own
    parameters (those not held by a ``fully_shard`` module inside it): reverse registration order, so a module comes
    before its parents."""
    held: set[int] = set()
    order = []
    for module in reversed(list(fsdp_modules(root))):
        own = [parameter for parameter in cast(nn.Module, module).parameters() if id(parameter) not in held]
        held.update(id(parameter) for parameter in own)
        order.append((module, own))
    return order


def _local(gradient: Tensor) -> Tensor:
    return gradient.to_local() if isinstance(gradient, DTensor) else gradient


class ShardAverage:
    """Averages every ``fully_shard`` module's gradient shards across replica groups, one collective per module, in
    one fixed order (this module's docstring says why and how).

    Args:
        root: The sharded LightningModule.
        manager: The Manager whose ``allreduce`` averages over the participating groups.
        device: Where the shards cross (the strategy's root device).
        before_allreduce: Called before each cross-group collective (the step protocol's quorum check).
    """

    def __init__(
        self,
        root: nn.Module,
        manager: Manager,
        device: torch.device,
        before_allreduce: Callable[[], None] = lambda: None,
    ) -> None:
        order = modules_in_order(root)
        self.modules: list[FSDPModule] = [module for module, _ in order]
        self._parameters: list[list[nn.Parameter]] = [own for _, own in order]
        self._manager = manager
        self._device = device
        self._before_allreduce = before_allreduce
        self._ready = [False] * len(order)
        self._next = 0  # the first module of the order that has not crossed in this backward pass
        self._reducing: int | None = None  # the module FSDP2 reduces now: its gradients are written at the next event

    def install(self) -> None:
        """Give each ``fully_shard`` module its all-reduce hook, which marks the module as being reduced."""
        for index, module in enumerate(self.modules):
            module.set_all_reduce_hook(self._reduce_hook(index))

    def _reduce_hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(_reduce_output: Tensor) -> None:
            self._settle()
            self._reducing = index

        return hook

    def backward_done(self) -> None:
        """After a backward pass: what the group left out gets zeros, and everything not crossed yet crosses, in
        order. A pass that reduced no module (gradient sync off) crosses nothing."""
        try:
            self._settle()
            if self._next == 0 and not any(self._ready):
                return
            for index in range(self._next, len(self.modules)):
                self._cross(index)
        finally:  # the next backward pass starts over, also after a failure here
            self._ready, self._next, self._reducing = [False] * len(self.modules), 0, None

    def _settle(self) -> None:
        """The module being reduced has its gradients now; every ready module crosses, in order."""
        if self._reducing is None:
            return
        self._ready[self._reducing], self._reducing = True, None
        while self._next < len(self.modules) and (self._ready[self._next] or not self._trainable(self._next)):
            self._cross(self._next)
            self._next += 1

    def _trainable(self, index: int) -> list[nn.Parameter]:
        return [parameter for parameter in self._parameters[index] if parameter.requires_grad]

    def _cross(self, index: int) -> None:
        """One collective: the module's trainable shards (zeros for one left out), averaged over the groups."""
        parameters = self._trainable(index)
        if not parameters:
            return
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        shards = [_local(parameter.grad) for parameter in parameters if parameter.grad is not None]
        self._before_allreduce()
        buffer = _flat(shards, self._device)
        self._manager.allreduce(buffer).wait()
        _unflatten(buffer, shards)


def _flat(shards: Sequence[Tensor], device: torch.device) -> Tensor:
    return torch.cat([shard.reshape(-1) for shard in shards]).to(device)


def _unflatten(buffer: Tensor, shards: Sequence[Tensor]) -> None:
    offset = 0
    for shard in shards:
        shard.copy_(buffer[offset : offset + shard.numel()].view_as(shard))
        offset += shard.numel()

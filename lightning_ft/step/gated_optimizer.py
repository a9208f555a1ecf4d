"""The optimizer Lightning's precision plugin steps under FTStrategy: it runs the closure, then steps the real
optimizer, with the closure, only when the step commits (:class:`CommitGatedOptimizer`), with the check of the
averaged gradient the vote reads.

It lives beside :mod:`lightning_ft.step.protocol`, whose vote it defers to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_ft.manager.vote_inputs import host_copy
from lightning_ft.step.protocol import StepProtocol


def finite_gradient_check(optimizer: Optimizer) -> Callable[[], bool]:
    """Queue the check of every gradient the optimizer would apply now; the returned function reads its answer.

    Read after the vote's device sync (:mod:`lightning_ft.manager.vote_inputs`), the answer costs no wait of its own.

    Why sums: an inf or NaN anywhere makes its tensor's sum inf or NaN, and a sum only reads the gradient, where
    ``isfinite(grad).all()`` writes a mask as large as the gradient and reads it again (on CPU that was the largest
    per-step cost of fault tolerance, see docs/benchmarks.md). A finite gradient whose sum overflows is the only
    false alarm; it is then checked element by element, so the answer is exact.

    Sharded (DTensor) gradients are checked shard by shard: each rank votes on its own shard, and the group's commit
    vote needs every rank's yes.
    """
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    if not grads:
        return lambda: True
    sums_finite = host_copy(torch.isfinite(torch.stack([grad.sum(dtype=torch.float32) for grad in grads])).all())

    def read() -> bool:
        return bool(sums_finite.item()) or all(bool(torch.isfinite(grad).all()) for grad in grads)

    return read


class EvaluatedClosure:
    """The closure as the real optimizer receives it, as Lightning would give it: its first call returns the
    evaluation already made (the forward and backward pass whose gradient the replica groups averaged and voted on);
    each further call evaluates the closure again (a two-pass optimizer such as SAM), with its gradient averaged in the
    same quorum."""

    def __init__(self, closure: Callable[[], Any], first_result: Any) -> None:
        self._closure = closure
        self._first_result = first_result
        self._first_taken = False
        self.evaluations_after_vote = 0

    def __call__(self) -> Any:
        if not self._first_taken:
            self._first_taken = True
            return self._first_result
        self.evaluations_after_vote += 1
        return self._closure()


class CommitGatedOptimizer:
    """An optimizer view whose ``step`` runs the closure and then steps only if the step commits.

    Everything else (``param_groups``, ``state``, ...) is the wrapped optimizer's, so precision plugins, gradient
    clipping and ``on_before_optimizer_step`` see the real thing. The real optimizer gets the closure
    (:class:`EvaluatedClosure`), so one that needs it, or evaluates it a fixed number of times more, steps as under
    Lightning. An optimizer that evaluates it a data-dependent number of times (LBFGS's line search) is refused
    up front (:mod:`lightning_ft.step.modes`): groups would make different numbers of cross-group collectives.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        protocol: StepProtocol,
        skip_non_finite: bool = True,
        gradient_check: Callable[[], Callable[[], bool] | None] | None = None,
        reduction_check: Callable[[], None] | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._protocol = protocol
        self._skip_non_finite = skip_non_finite
        # The check of the averaged gradient that the comm hook queued while averaging it
        # (lightning_ft.step.gradient_hooks); None when it could not tell, and the optimizer's gradients are then
        # checked here.
        self._gradient_check = gradient_check
        # Raises if the closure's backward pass left gradients out of the cross-group average
        # (lightning_ft.step.unfinished_reduction): before the vote, and before a later optimizer of a decided step.
        self._reduction_check = reduction_check

    def _finite_check(self) -> Callable[[], bool]:
        check = self._gradient_check() if self._gradient_check is not None else None
        return check if check is not None else finite_gradient_check(self._optimizer)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        if self._reduction_check is not None:
            self._reduction_check()
        # Both are read after the vote's device sync, before the vote is cast; queued already at the end of the
        # backward pass where a vote fence marks it (StepOwner.backward_done).
        if not self._protocol.decided and not self._protocol.vote_inputs_queued:
            self._protocol.read_at_vote(
                finite=self._finite_check() if self._skip_non_finite else None,
                loss=loss if isinstance(loss, Tensor) and loss.numel() == 1 else None,
            )
        if not self._protocol.commit():
            return loss
        if closure is None:
            return self._optimizer.step(**kwargs)
        evaluated = EvaluatedClosure(closure, loss)
        output = self._optimizer.step(closure=evaluated, **kwargs)
        if evaluated.evaluations_after_vote:
            # A collective of a later evaluation that failed leaves this replica unlike its peers: the group stops
            # and heals from a live peer (StepProtocol.commit, called again, raises).
            self._protocol.commit()
        return output  # what the optimizer returns, as under Lightning (torch's return the closure's loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

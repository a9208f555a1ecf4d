"""Which of Lightning's optimization modes FTStrategy runs, checked when fitting starts.

Every mode runs one quorum and one commit vote per optimizer step (:mod:`.protocol`): automatic and manual
optimization, several optimizers (they share the batch's one decision), gradient accumulation, ``16-mixed`` and
``bf16-mixed`` (GradScaler's state travels in a heal), ``torch.compile``d modules, ``training_step(dataloader_iter)``.

Refused, with an :class:`~lightning_ft.settings.FTConfigError` that names the optimizer and what to use instead:

* an optimizer whose ``step`` evaluates the closure a number of times that depends on the loss
  (``torch.optim.LBFGS``'s line search): each evaluation averages its gradient across the replica groups, and groups
  whose losses differ would make different numbers of those collectives. An optimizer that evaluates it a fixed
  number of times (SAM's two passes) steps as under Lightning (:mod:`.gated_optimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from lightning_ft.settings import FTConfigError

# Optimizers whose step() calls the closure a loss-dependent number of times (line search).
_CLOSURE_EVALUATING = (torch.optim.LBFGS,)


def check_optimizers(optimizers: Sequence[Optimizer], semi_sync: bool) -> None:
    """Raise :class:`FTConfigError` for an optimizer FTStrategy cannot step (see the module)."""
    if semi_sync:  # inner steps are group-local: any optimizer
        return
    for index, optimizer in enumerate(optimizers):
        if isinstance(optimizer, _CLOSURE_EVALUATING):
            raise FTConfigError(
                f"lightning-ft: optimizer {index} is {type(optimizer).__name__}, whose step() evaluates the closure "
                f"a number of times that depends on the loss; FTStrategy averages each evaluation's gradient across "
                f"replica groups, and groups whose losses differ would make different numbers of collectives. Use a "
                f"first-order optimizer (SGD, Adam, AdamW, ...), or FTStrategy(algorithm='local_sgd'), whose inner "
                f"steps stay inside the group."
            )


def check_nothing_unfrozen(module: torch.nn.Module) -> None:
    """Raise :class:`FTConfigError` if a model that was frozen when the fit started (and so was not wrapped in DDP,
    which refuses it) now has a gradient: in a job of several processes nothing would average it."""
    if any(parameter.grad is not None for parameter in module.parameters()):
        raise FTConfigError(
            "lightning-ft: every parameter of the model was frozen when the fit started, so FTStrategy did not wrap it "
            "for data parallelism (torch's DDP refuses such a model); a parameter unfrozen since then has a gradient "
            "that nothing averages across the job's processes. Leave at least one parameter trainable from the start "
            "(for example the head that BackboneFinetuning trains first)."
        )

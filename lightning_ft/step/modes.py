"""Which of Lightning's optimization modes FTStrategy runs, checked when fitting starts.

Every mode runs one quorum and one commit vote per optimizer step (:mod:`.protocol`): automatic and manual
optimization, several optimizers (they share the batch's one decision), gradient accumulation, ``16-mixed`` and
``bf16-mixed`` (GradScaler's state travels in a heal), ``torch.compile``d modules, ``training_step(dataloader_iter)``.

Refused, with an :class:`~lightning_ft.settings.FTConfigError` that names the optimizer and what to use instead:

* an optimizer whose ``step`` evaluates the closure itself, again and again (``torch.optim.LBFGS``): the replicas
  agree to average exactly one gradient per step, the one the closure computed once; a second evaluation would
  apply a gradient no other replica saw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from lightning_ft.settings import FTConfigError

# Optimizers whose step() calls the closure several times (line search).
_CLOSURE_EVALUATING = (torch.optim.LBFGS,)


def check_optimizers(optimizers: Sequence[Optimizer], semi_sync: bool) -> None:
    """Raise :class:`FTConfigError` for an optimizer FTStrategy cannot step (see the module)."""
    if semi_sync:  # inner steps are group-local: any optimizer
        return
    for index, optimizer in enumerate(optimizers):
        if isinstance(optimizer, _CLOSURE_EVALUATING):
            raise FTConfigError(
                f"lightning-ft: optimizer {index} is {type(optimizer).__name__}, whose step() evaluates the closure "
                f"several times; FTStrategy averages exactly one gradient per step across replica groups and steps the "
                f"optimizer once. Use a first-order optimizer (SGD, Adam, AdamW, ...), or "
                f"FTStrategy(algorithm='local_sgd'), whose inner steps stay inside the group."
            )

"""Semi-synchronous training across replica groups: LocalSGD and (streaming) DiLoCo.

``FTStrategy(algorithm="ddp")`` (the default) averages gradients across groups every step. The algorithms here let
each group take ``sync_every`` inner optimizer steps on its own and only then synchronise across groups. See
``docs/semi-sync.md`` for the design; this package holds one job per module:

* :mod:`~lightning_ft.algorithms.config`: the settings and their validation;
* :mod:`~lightning_ft.algorithms.outer_optimizer`: DiLoCo's outer optimizer from YAML (``class_path``/``init_args``)
  or a callable;
* :mod:`~lightning_ft.algorithms.fragments`: the model fragments of streaming DiLoCo.
"""

from lightning_ft.algorithms.config import ALGORITHMS, AlgorithmName, AlgorithmSettings, resolve_algorithm
from lightning_ft.algorithms.fragments import resolve_fragments
from lightning_ft.algorithms.outer_optimizer import (
    DEFAULT_OUTER_OPTIMIZER,
    OuterOptimizerFactory,
    outer_optimizer_factory,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_OUTER_OPTIMIZER",
    "AlgorithmName",
    "AlgorithmSettings",
    "OuterOptimizerFactory",
    "outer_optimizer_factory",
    "resolve_algorithm",
    "resolve_fragments",
]

"""The semi-synchronous settings of FTStrategy, resolved and checked up front.

Like :mod:`lightning_ft.settings`, every wrong value or combination fails when the strategy is built, with a message
that names the setting and the fix: a bad combination would otherwise surface as a torchft assertion after the
first ``sync_every`` steps, or not at all (torchft quietly falls back to an unquantised allreduce without Triton).
Checks that need the model (fragment module names) run at setup, in :func:`~lightning_ft.algorithms.fragments.
resolve_fragments`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from lightning_ft.algorithms.fragments import FragmentSpec, check_fragment_spec
from lightning_ft.algorithms.outer_optimizer import OuterOptimizerFactory, OuterOptimizerSpec, outer_optimizer_factory
from lightning_ft.settings import ALGORITHMS, AlgorithmName, FTConfigError

log = logging.getLogger("lightning.pytorch.lightning_ft")


@dataclass(frozen=True)
class AlgorithmSettings:
    """How replica groups synchronise. ``ddp``: every step; ``local_sgd``/``diloco``: every ``sync_every`` inner
    optimizer steps (``sync_every // num_fragments`` for one fragment of streaming DiLoCo)."""

    algorithm: AlgorithmName
    sync_every: int | None = None
    outer_optimizer: OuterOptimizerFactory | None = None
    fragments: FragmentSpec = 1
    num_fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    quantize: bool = False

    @property
    def semi_sync(self) -> bool:
        """Whether groups take inner steps on their own between syncs."""
        return self.algorithm != "ddp"

    @property
    def sync_period(self) -> int:
        """Inner steps between two syncs (of consecutive fragments, for streaming DiLoCo); 1 for ``ddp``."""
        if self.sync_every is None:
            return 1
        return self.sync_every // self.num_fragments


def _quantization_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def resolve_algorithm(
    *,
    algorithm: str,
    use_async_quorum: bool,
    sync_every: int | None,
    outer_optimizer: OuterOptimizerSpec,
    fragments: FragmentSpec | None,
    fragment_sync_delay: int | None,
    fragment_update_alpha: float | None,
    quantize: bool,
) -> AlgorithmSettings:
    """Validate the algorithm settings. ``None`` means "not set": DiLoCo-only settings must stay unset otherwise.
    ``use_async_quorum`` is the resolved value (its default is decided in :mod:`lightning_ft.configuration`); DiLoCo
    refuses ``True``."""
    if algorithm not in ALGORITHMS:
        raise FTConfigError(f"algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}.")

    if algorithm == "ddp":
        if sync_every is not None:
            raise FTConfigError(
                "sync_every only applies to algorithm='local_sgd' or 'diloco'; algorithm='ddp' synchronises every "
                "step. Remove sync_every or choose a semi-synchronous algorithm."
            )
    else:
        if sync_every is None:
            raise FTConfigError(f"algorithm={algorithm!r} needs sync_every=N: the inner steps between two syncs.")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise FTConfigError(f"sync_every={sync_every!r}: must be a positive integer number of inner steps.")

    diloco_only = {
        "outer_optimizer": outer_optimizer,
        "fragments": fragments,
        "fragment_sync_delay": fragment_sync_delay,
        "fragment_update_alpha": fragment_update_alpha,
        "quantize": quantize or None,
    }
    if algorithm != "diloco":
        given = [name for name, value in diloco_only.items() if value is not None]
        if given:
            raise FTConfigError(
                f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to algorithm='diloco', but "
                f"algorithm={algorithm!r}. Remove {'it' if len(given) == 1 else 'them'} or use algorithm='diloco'."
            )
        return AlgorithmSettings(algorithm=algorithm, sync_every=sync_every)  # type: ignore[arg-type]

    assert sync_every is not None
    if use_async_quorum:
        raise FTConfigError(
            "use_async_quorum=True cannot be used with algorithm='diloco': a restarted group must receive the backup "
            "parameters and outer optimizer state before it joins a sync (torchft's DiLoCo requires a synchronous "
            "quorum). Remove use_async_quorum (it defaults to False for DiLoCo) or set it to False."
        )
    fragment_spec: FragmentSpec = 1 if fragments is None else fragments
    num_fragments = check_fragment_spec(fragment_spec)
    if sync_every < num_fragments or sync_every % num_fragments:
        raise FTConfigError(
            f"sync_every={sync_every} is not divisible by the number of fragments ({num_fragments}): each fragment "
            f"syncs once every sync_every inner steps, one fragment every sync_every/{num_fragments} steps. Use a "
            f"multiple of {num_fragments}, e.g. sync_every={num_fragments * max(1, round(sync_every / num_fragments))}."
        )
    period = sync_every // num_fragments
    delay = 0 if fragment_sync_delay is None else fragment_sync_delay
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise FTConfigError(f"fragment_sync_delay={delay!r}: must be a non-negative integer number of inner steps.")
    if delay >= period:
        raise FTConfigError(
            f"fragment_sync_delay={delay} must be smaller than sync_every/fragments={period}: a fragment's sync must "
            f"finish before the next fragment's starts. Lower fragment_sync_delay below {period} or raise sync_every."
        )
    alpha = 0.0 if fragment_update_alpha is None else fragment_update_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise FTConfigError(
            f"fragment_update_alpha={alpha!r}: must be in [0, 1] (0 takes the new global parameters, 1 keeps the "
            f"local ones)."
        )
    if quantize:
        reason = _quantization_unavailable()
        if reason is not None:
            raise FTConfigError(
                f"quantize=True needs a CUDA device and Triton, but {reason}. torchft would silently send unquantised "
                f"pseudo-gradients; remove quantize or train on GPUs."
            )
    settings = AlgorithmSettings(
        algorithm="diloco",
        sync_every=sync_every,
        outer_optimizer=outer_optimizer_factory(outer_optimizer),
        fragments=fragment_spec,
        num_fragments=num_fragments,
        fragment_sync_delay=delay,
        fragment_update_alpha=float(alpha),
        quantize=bool(quantize),
    )
    return settings


def warn_unsynced_tail(settings: AlgorithmSettings, max_steps: int) -> None:
    """The final sync happens only at a sync step: with ``max_steps`` not a multiple of the sync period, the last
    inner steps stay local and the replicas end different. Says so once, at setup."""
    period = settings.sync_period
    if max_steps > 0 and max_steps % period:
        log.warning(
            "lightning-ft: max_steps=%d is not a multiple of the sync period %d (sync_every / fragments); the "
            "last %d inner steps are not synchronised, so replica groups end with different parameters.",
            max_steps,
            period,
            max_steps % period,
        )

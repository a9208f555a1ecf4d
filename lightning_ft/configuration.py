"""FTStrategy's constructor arguments, resolved once: the torchft settings, the algorithm, the data mode and the
data parallelism inside a group, each derived value stored in one place.

The order matters for the defaults: ``use_async_quorum`` is ``True`` only for ``algorithm="ddp"`` with sharded data
and DDP inside the group; exactly-once data, the semi-synchronous algorithms and FSDP each need the quorum before
the forward pass, so each turns the default off and refuses an explicit ``True`` with a message naming both settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_ft.algorithms import AlgorithmSettings, resolve_algorithm
from lightning_ft.data.placement import resolve_data_mode
from lightning_ft.hsdp.data_parallel import DataParallelSettings, resolve_data_parallel
from lightning_ft.settings import FTConfigError, FTSettings, resolve_settings

_FSDP_ARGUMENTS = (
    "fsdp_wrap",
    "fsdp_min_params",
    "fsdp_mixed_precision",
    "fsdp_cpu_offload",
    "fsdp_reshard_after_forward",
)
_SEMI_SYNC_ARGUMENTS = (
    "sync_every",
    "outer_optimizer",
    "fragments",
    "fragment_sync_delay",
    "fragment_update_alpha",
    "quantize",
)
# DDP settings that FTStrategy replaces with its own cross-group comm hook.
_COMM_HOOK_KWARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


@dataclass(frozen=True)
class StrategyConfiguration:
    """What FTStrategy's constructor resolved. ``ddp_kwargs`` go on to ``DDPStrategy`` (and torch's DDP)."""

    settings: FTSettings
    algorithm: AlgorithmSettings
    data_parallel: DataParallelSettings
    data_mode: str
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)


def resolve_configuration(
    *,
    data_mode: str,
    algorithm: str,
    use_async_quorum: bool | None,
    data_parallel: str,
    find_unused_parameters: Any,
    gradient_as_bucket_view: bool,
    ddp_kwargs: dict[str, Any],
    **arguments: Any,
) -> StrategyConfiguration:
    """Validate every setting against the others. Raises :class:`FTConfigError` naming the setting and the fix.

    Args:
        ddp_kwargs: FTStrategy's ``**kwargs``, for ``DDPStrategy`` and torch's DDP.
        arguments: The other FTStrategy arguments: the ``fsdp_*`` ones, the semi-synchronous ones (``sync_every``,
            ``outer_optimizer``, ``fragment*``, ``quantize``) and those of
            :func:`~lightning_ft.settings.resolve_settings`.
    """
    fsdp = {name: arguments.pop(name) for name in _FSDP_ARGUMENTS}
    semi_sync = {name: arguments.pop(name) for name in _SEMI_SYNC_ARGUMENTS}
    use_async_quorum = resolve_data_mode(data_mode, algorithm, use_async_quorum)
    parallel = resolve_data_parallel(
        data_parallel=data_parallel,
        algorithm=algorithm,
        use_async_quorum=use_async_quorum,
        ddp_kwargs=ddp_kwargs,
        **fsdp,
    )
    ddp_kwargs = dict(ddp_kwargs)
    if parallel.sharded:
        use_async_quorum = False  # FSDP2 reshards parameters in the forward pass; an async quorum would read them
    else:
        _check_ddp_kwargs(find_unused_parameters, ddp_kwargs)
        ddp_kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
    # With False the DDP hook pins the bucket layout before the first step (step.gradient_hooks.pin_bucket_layout).
    ddp_kwargs["find_unused_parameters"] = find_unused_parameters is not False or parallel.sharded
    chosen, async_quorum = resolve_algorithm(algorithm=algorithm, use_async_quorum=use_async_quorum, **semi_sync)
    return StrategyConfiguration(
        settings=resolve_settings(use_async_quorum=async_quorum, **arguments),
        algorithm=chosen,
        data_parallel=parallel,
        data_mode=data_mode,
        ddp_kwargs=ddp_kwargs,
    )


def _check_ddp_kwargs(find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
    if not isinstance(find_unused_parameters, bool):
        raise FTConfigError(f"find_unused_parameters={find_unused_parameters!r}: expected True or False.")
    for unsupported in _COMM_HOOK_KWARGS:
        if kwargs.get(unsupported) is not None:
            raise FTConfigError(f"{unsupported}: FTStrategy installs its own cross-group comm hook; remove it.")

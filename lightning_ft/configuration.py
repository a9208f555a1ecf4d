"""FTStrategy's constructor arguments, resolved once: the torchft settings, the algorithm, the data mode and the
data parallelism inside a group, each derived value stored in one place.

Every argument arrives by name (:func:`resolve_configuration`), and every default that depends on other settings is
decided here, once: ``use_async_quorum`` (:func:`async_quorum_default`). The modules of each concept
(:mod:`lightning_ft.settings`, :mod:`lightning_ft.algorithms`, :mod:`lightning_ft.data.placement`,
:mod:`lightning_ft.hsdp.data_parallel`) validate their own settings against the resolved values.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ft.algorithms import AlgorithmSettings, resolve_algorithm
from lightning_ft.algorithms.fragments import FragmentSpec
from lightning_ft.algorithms.outer_optimizer import OuterOptimizerSpec
from lightning_ft.data.placement import check_data_mode
from lightning_ft.hsdp.data_parallel import DataParallelSettings, resolve_data_parallel
from lightning_ft.settings import (
    AlgorithmName,
    BufferSyncName,
    DataModeName,
    DataParallelName,
    FTConfigError,
    FTSettings,
    ProcessGroupName,
    TransportName,
    WorldSizeModeName,
    resolve_settings,
)

# FSDP2's ``fully_shard`` arguments that FTStrategy takes under its own names (``data_parallel="fsdp"``).
_FSDP2_NAMES = {
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "mp_policy": "fsdp_mixed_precision",
    "offload_policy": "fsdp_cpu_offload",
}

# DDP settings that FTStrategy replaces with its own cross-group comm hook.
_COMM_HOOK_KWARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


@dataclass(frozen=True)
class StrategyConfiguration:
    """What FTStrategy's constructor resolved. ``ddp_kwargs`` go on to ``DDPStrategy`` (and torch's DDP)."""

    settings: FTSettings
    algorithm: AlgorithmSettings
    data_parallel: DataParallelSettings
    data_mode: DataModeName
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    # Whether DDP searches for unused parameters because FTStrategy chose it (the user set nothing).
    unused_search_by_default: bool = False


def async_quorum_default(*, algorithm: str, data_mode: str, data_parallel: str) -> bool:
    """``use_async_quorum`` when it is not given: ``True`` only for per-step training (``algorithm="ddp"``) with
    sharded data and DDP inside the group. The others need the quorum before the forward pass: exactly-once data
    (a step's samples depend on its quorum), the semi-synchronous algorithms (a restarted group heals before the
    sync it joins) and FSDP2 (it reshards parameters in the forward pass, which an asynchronous heal would read).
    Each of those refuses an explicit ``True`` with a message naming both settings."""
    return algorithm == "ddp" and data_mode == "sharded" and data_parallel == "ddp"


def resolve_configuration(
    *,
    replica_group_id: int | None,
    num_replica_groups: int | None,
    lighthouse: str | None,
    min_replica_size: int,
    use_async_quorum: bool | None,
    timeout: float,
    quorum_timeout: float,
    connect_timeout: float,
    init_sync: bool,
    max_retries: int | None,
    process_group: ProcessGroupName,
    checkpoint_transport: TransportName,
    hostname: str | None,
    interface: str | None,
    replica_id_prefix: str,
    skip_non_finite_steps: bool,
    buffer_sync: BufferSyncName,
    lighthouse_outage_timeout: float | None,
    start_timeout: float | None,
    world_size_mode: WorldSizeModeName,
    data_mode: DataModeName,
    algorithm: AlgorithmName,
    sync_every: int | None,
    outer_optimizer: OuterOptimizerSpec,
    fragments: FragmentSpec | None,
    fragment_sync_delay: int | None,
    fragment_update_alpha: float | None,
    quantize: bool,
    data_parallel: DataParallelName,
    fsdp_wrap: list[str] | None,
    fsdp_min_params: int | None,
    fsdp_mixed_precision: dict[str, Any] | None,
    fsdp_cpu_offload: bool,
    fsdp_reshard_after_forward: bool | None,
    gradient_as_bucket_view: bool,
    find_unused_parameters: bool | None,
    ddp_kwargs: dict[str, Any],
    strategy_arguments: Collection[str] = (),
) -> StrategyConfiguration:
    """Validate every setting against the others. Raises :class:`FTConfigError` naming the setting and the fix.

    Args: FTStrategy's, by the same names (``docs/configuration.md``); ``ddp_kwargs`` are its ``**kwargs``, for
    ``DDPStrategy`` and torch's DDP; ``strategy_arguments`` are FTStrategy's own argument names (the suggestions
    for a misspelled one).
    """
    check_argument_names(ddp_kwargs, strategy_arguments)
    if use_async_quorum is None:
        use_async_quorum = async_quorum_default(algorithm=algorithm, data_mode=data_mode, data_parallel=data_parallel)
    check_data_mode(data_mode, algorithm, use_async_quorum)
    parallel = resolve_data_parallel(
        data_parallel=data_parallel,
        algorithm=algorithm,
        use_async_quorum=use_async_quorum,
        fsdp_wrap=fsdp_wrap,
        fsdp_min_params=fsdp_min_params,
        fsdp_mixed_precision=fsdp_mixed_precision,
        fsdp_cpu_offload=fsdp_cpu_offload,
        fsdp_reshard_after_forward=fsdp_reshard_after_forward,
        ddp_kwargs=ddp_kwargs,
    )
    ddp_kwargs = dict(ddp_kwargs)
    if not parallel.sharded:
        _check_ddp_kwargs(find_unused_parameters, ddp_kwargs)
        ddp_kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
    chosen = resolve_algorithm(
        algorithm=algorithm,
        use_async_quorum=use_async_quorum,
        sync_every=sync_every,
        outer_optimizer=outer_optimizer,
        fragments=fragments,
        fragment_sync_delay=fragment_sync_delay,
        fragment_update_alpha=fragment_update_alpha,
        quantize=quantize,
    )
    settings = resolve_settings(
        replica_group_id=replica_group_id,
        num_replica_groups=num_replica_groups,
        lighthouse=lighthouse,
        min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout,
        init_sync=init_sync,
        max_retries=max_retries,
        process_group=process_group,
        checkpoint_transport=checkpoint_transport,
        hostname=hostname,
        interface=interface,
        replica_id_prefix=replica_id_prefix,
        skip_non_finite_steps=skip_non_finite_steps,
        buffer_sync=buffer_sync,
        lighthouse_outage_timeout=lighthouse_outage_timeout,
        start_timeout=start_timeout,
        world_size_mode=world_size_mode,
    )
    # FTStrategy's default is the search: one bucket layout in every group (lightning_ft.step.unused_parameter_note).
    ddp_kwargs["find_unused_parameters"] = parallel.sharded or find_unused_parameters is not False
    return StrategyConfiguration(
        settings=settings,
        algorithm=chosen,
        data_parallel=parallel,
        data_mode=data_mode,
        ddp_kwargs=ddp_kwargs,
        unused_search_by_default=find_unused_parameters is None and not parallel.sharded,
    )


def forwarded_argument_names() -> frozenset[str]:
    """The keyword arguments that ``FTStrategy(**kwargs)`` passes on: ``DDPStrategy``'s and torch
    ``DistributedDataParallel``'s (Lightning hands the latter's to the wrapper at setup)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    names: set[str] = set()
    for function in (DDPStrategy.__init__, DistributedDataParallel.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                names.add(name)
    return frozenset(names - {"self", "module"})


def check_argument_names(kwargs: Mapping[str, Any], strategy_arguments: Collection[str]) -> None:
    """Refuse, at construction, a keyword argument that no one downstream accepts.

    Without this a misspelled argument (``replica_groups=2``) travels in ``**kwargs`` to torch's DDP constructor and
    fails at setup, after the lighthouse and process groups have started, in a traceback about
    ``DistributedDataParallel.__init__()``.

    Raises:
        FTConfigError: naming each unknown argument and the nearest valid names.
    """
    forwarded = forwarded_argument_names()
    unknown = [name for name in kwargs if name not in forwarded]
    if not unknown:
        return
    valid = sorted(set(strategy_arguments) | forwarded)
    problems = []
    for name in unknown:
        if name in _FSDP2_NAMES:
            problems.append(f"{name} (FSDP2's name: FTStrategy takes it as {_FSDP2_NAMES[name]})")
            continue
        nearest = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
        hint = ", ".join(nearest[:-1]) + (" or " if len(nearest) > 1 else "") + nearest[-1] if nearest else ""
        problems.append(f"{name} (did you mean {hint}?)" if hint else name)
    raise FTConfigError(
        f"FTStrategy: unknown argument{'s' if len(unknown) > 1 else ''} {'; '.join(problems)}: neither FTStrategy, "
        f"DDPStrategy nor torch's DistributedDataParallel accepts {'them' if len(unknown) > 1 else 'it'}. Every "
        f"argument: docs/configuration.md."
    )


def _check_ddp_kwargs(find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
    if find_unused_parameters is not None and not isinstance(find_unused_parameters, bool):
        raise FTConfigError(f"find_unused_parameters={find_unused_parameters!r}: expected True, False or None.")
    for unsupported in _COMM_HOOK_KWARGS:
        if kwargs.get(unsupported) is not None:
            raise FTConfigError(f"{unsupported}: FTStrategy installs its own cross-group comm hook; remove it.")

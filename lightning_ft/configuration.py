"""FTStrategy's constructor arguments, resolved once: the torchft settings, the algorithm, the data mode and the
data parallelism inside a group, each derived value stored in one place.

FTStrategy's signature is each argument's one definition (name, type, default; its doc in the class docstring, from
which ``docs/configuration.md``'s table is generated). The arguments arrive here as one mapping
(:func:`resolve_configuration`); each concept's resolver takes the ones its parameters name (:func:`taken_by`):
:mod:`lightning_ft.settings`, :mod:`lightning_ft.algorithms`, :mod:`lightning_ft.hsdp.data_parallel` validate their
own settings against the resolved values, :mod:`lightning_ft.data.placement` the data mode. Every default that
depends on other settings is decided here, once: ``use_async_quorum`` (:func:`async_quorum_default`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ft.algorithms import AlgorithmSettings, resolve_algorithm
from lightning_ft.data.placement import check_data_mode
from lightning_ft.hsdp.data_parallel import DataParallelSettings, resolve_data_parallel
from lightning_ft.settings import DataModeName, FTConfigError, FTSettings, resolve_settings

# FSDP2's ``fully_shard`` arguments that FTStrategy takes under its own names (``data_parallel="fsdp"``).
_FSDP2_NAMES = {
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "mp_policy": "fsdp_mixed_precision",
    "offload_policy": "fsdp_cpu_offload",
}

# DDP's bucket size when the user sets none: torch's own default, passed explicitly. Each DDP bucket is one cross-group
# collective per step. Left unset, torch gives its first bucket a 1-MiB cap instead (so that the first allreduce
# starts early in the backward pass): a model of 1 to 25 MiB of gradients then makes two cross-group collectives per
# step instead of one, and every larger one an extra collective. A cross-group collective costs more than the memory
# it moves at that size (the quorum check, the process group's watch, a round trip between groups), so FTStrategy
# asks torch for 25 MiB in every bucket; torch applies an explicit cap to the first bucket too.
DEFAULT_BUCKET_CAP_MB = 25

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


def resolve_configuration(arguments: Mapping[str, Any], ddp_kwargs: Mapping[str, Any]) -> StrategyConfiguration:
    """Validate every setting against the others. Raises :class:`FTConfigError` naming the setting and the fix.

    Args:
        arguments: FTStrategy's own arguments by name, as its signature (their one definition) received them.
        ddp_kwargs: Its ``**kwargs``, for ``DDPStrategy`` and torch's DDP.
    """
    check_argument_names(ddp_kwargs, arguments)
    values = dict(arguments)
    if values["use_async_quorum"] is None:
        values["use_async_quorum"] = async_quorum_default(
            algorithm=values["algorithm"], data_mode=values["data_mode"], data_parallel=values["data_parallel"]
        )
    check_data_mode(values["data_mode"], values["algorithm"], values["use_async_quorum"])
    parallel = resolve_data_parallel(**taken_by(resolve_data_parallel, values), ddp_kwargs=ddp_kwargs)
    find_unused_parameters = values["find_unused_parameters"]
    passed_on = dict(ddp_kwargs)
    if not parallel.sharded:
        _check_ddp_kwargs(find_unused_parameters, passed_on)
        passed_on["gradient_as_bucket_view"] = values["gradient_as_bucket_view"]
        if passed_on.get("bucket_cap_mb") is None:
            passed_on["bucket_cap_mb"] = DEFAULT_BUCKET_CAP_MB
    chosen = resolve_algorithm(**taken_by(resolve_algorithm, values))
    settings = resolve_settings(**taken_by(resolve_settings, values))
    # FTStrategy's default is the search: one bucket layout in every group (lightning_ft.step.unused_parameter_note).
    passed_on["find_unused_parameters"] = parallel.sharded or find_unused_parameters is not False
    return StrategyConfiguration(
        settings=settings,
        algorithm=chosen,
        data_parallel=parallel,
        data_mode=values["data_mode"],
        ddp_kwargs=passed_on,
        unused_search_by_default=find_unused_parameters is None and not parallel.sharded,
    )


def taken_by(resolver: Callable[..., Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments ``resolver`` takes, by the names of its parameters."""
    return {name: values[name] for name in inspect.signature(resolver).parameters if name in values}


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

"""The data-parallel settings of FTStrategy (``data_parallel="ddp"`` or ``"fsdp"``), resolved and checked up front.

Like :mod:`lightning_ft.settings`, every wrong value or combination fails when the strategy is built, with a message
that names the setting and the fix. A wrong FSDP setting would otherwise surface deep inside ``fully_shard`` at
setup, or not at all (an option that silently does nothing because ``configure_model`` already sharded the model).
Checks that need the model (do the listed module classes exist in it, did ``configure_model`` shard it already) run
at setup, in :mod:`lightning_ft.hsdp.sharding`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_ft.settings import DATA_PARALLEL, DataParallelName, FTConfigError

# MixedPrecisionPolicy's fields, and the dtype spellings accepted for them (YAML cannot name a torch.dtype).
_PRECISION_DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")
_PRECISION_FIELDS = (*_PRECISION_DTYPE_FIELDS, "cast_forward_inputs")
_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

# DDPStrategy's own settings that still mean something when the group shards with FSDP2, and
# find_unused_parameters, which FTStrategy defaults to True (LightningCLI passes it as True) and ignores with FSDP2.
_KWARGS_KEPT_WITH_FSDP = ("start_method", "find_unused_parameters")


def _ddp_defaults() -> dict[str, Any]:
    """The defaults of DDPStrategy's and torch DDP's keyword arguments. LightningCLI passes every one of them (at its
    default) to FTStrategy, so only a value that differs from its default is a setting the user made."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    defaults: dict[str, Any] = {}
    for function in (DistributedDataParallel.__init__, DDPStrategy.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults[name] = parameter.default
    return defaults


def _is_default(name: str, value: Any, defaults: Mapping[str, Any]) -> bool:
    if name not in defaults:
        return False
    default = defaults[name]
    try:
        return value is default or bool(value == default)
    except Exception:  # a value whose == is not a plain truth value (a tensor, say) is not a default
        return False


@dataclass(frozen=True)
class FSDPSettings:
    """How a replica group shards its model with FSDP2 when ``configure_model`` has not done it.

    ``wrap_classes`` and ``min_params`` form the auto-wrap policy: a module is given its own ``fully_shard`` (its own
    all-gather and reduce-scatter) when its class is listed, or when it holds at least ``min_params`` parameters not
    already covered by a wrapped submodule. The LightningModule itself is always sharded last, as the catch-all.
    """

    wrap_classes: tuple[str, ...] = ()
    min_params: int | None = None
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    cpu_offload: bool = False
    reshard_after_forward: bool | None = None

    @property
    def offload_policy(self) -> OffloadPolicy:
        # Pinned memory only helps (and only works) with an accelerator to copy to.
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()

    @property
    def sharding_options_given(self) -> list[str]:
        """The options that only apply when FTStrategy shards the model itself (named as FTStrategy arguments)."""
        given = []
        if self.wrap_classes:
            given.append("fsdp_wrap")
        if self.min_params is not None:
            given.append("fsdp_min_params")
        if self.mixed_precision != MixedPrecisionPolicy():
            given.append("fsdp_mixed_precision")
        if self.cpu_offload:
            given.append("fsdp_cpu_offload")
        if self.reshard_after_forward is not None:
            given.append("fsdp_reshard_after_forward")
        return given


@dataclass(frozen=True)
class DataParallelSettings:
    """How a replica group is data parallel inside itself: DDP (every rank a full replica) or FSDP2 (sharded)."""

    data_parallel: DataParallelName = "ddp"
    fsdp: FSDPSettings | None = None

    @property
    def sharded(self) -> bool:
        """Whether each rank of a group holds only a shard of the model and optimizer state."""
        return self.data_parallel == "fsdp"


def _mixed_precision(value: Mapping[str, Any] | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if not isinstance(value, Mapping):
        raise FTConfigError(
            f"fsdp_mixed_precision={value!r}: expected a mapping such as "
            f"{{'param_dtype': 'bfloat16', 'reduce_dtype': 'float32'}} (or a torch MixedPrecisionPolicy)."
        )
    unknown = sorted(set(value) - set(_PRECISION_FIELDS))
    if unknown:
        raise FTConfigError(
            f"fsdp_mixed_precision: unknown key(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(_PRECISION_FIELDS)}."
        )
    kwargs: dict[str, Any] = {}
    for name in _PRECISION_DTYPE_FIELDS:
        dtype = value.get(name)
        if dtype is None:
            continue
        if isinstance(dtype, torch.dtype):
            kwargs[name] = dtype
        elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
            kwargs[name] = _DTYPES[dtype.removeprefix("torch.")]
        else:
            raise FTConfigError(
                f"fsdp_mixed_precision.{name}={dtype!r}: choose a dtype name such as 'bfloat16', 'float16' or "
                f"'float32'."
            )
    if "cast_forward_inputs" in value:
        cast = value["cast_forward_inputs"]
        if not isinstance(cast, bool):
            raise FTConfigError(f"fsdp_mixed_precision.cast_forward_inputs={cast!r}: must be true or false.")
        kwargs["cast_forward_inputs"] = cast
    return MixedPrecisionPolicy(**kwargs)


def _wrap_classes(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise FTConfigError(
                f"fsdp_wrap={value!r}: expected module class names, e.g. ['TransformerBlock'] or "
                f"['torch.nn.TransformerEncoderLayer']."
            )
    return tuple(name.strip() for name in names)


def resolve_data_parallel(
    *,
    data_parallel: str,
    algorithm: str,
    use_async_quorum: bool,
    fsdp_wrap: str | Sequence[str] | None,
    fsdp_min_params: int | None,
    fsdp_mixed_precision: Mapping[str, Any] | MixedPrecisionPolicy | None,
    fsdp_cpu_offload: bool,
    fsdp_reshard_after_forward: bool | None,
    ddp_kwargs: Mapping[str, Any],
) -> DataParallelSettings:
    """Validate ``data_parallel`` and the ``fsdp_*`` options against each other and the rest of FTStrategy."""
    if data_parallel not in DATA_PARALLEL:
        raise FTConfigError(
            f"data_parallel={data_parallel!r}: choose 'ddp' (every rank of a replica group holds a full replica) or "
            f"'fsdp' (FSDP2 shards the model inside each group)."
        )
    fsdp_given = {
        "fsdp_wrap": fsdp_wrap,
        "fsdp_min_params": fsdp_min_params,
        "fsdp_mixed_precision": fsdp_mixed_precision,
        "fsdp_cpu_offload": fsdp_cpu_offload or None,
        "fsdp_reshard_after_forward": fsdp_reshard_after_forward,
    }
    if data_parallel == "ddp":
        given = [name for name, value in fsdp_given.items() if value is not None]
        if given:
            raise FTConfigError(
                f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to data_parallel='fsdp', but "
                f"data_parallel='ddp'. Remove {'it' if len(given) == 1 else 'them'} or set data_parallel='fsdp'."
            )
        return DataParallelSettings()

    if algorithm != "ddp":
        raise FTConfigError(
            f"data_parallel='fsdp' cannot be combined with algorithm={algorithm!r} yet: the semi-synchronous "
            f"algorithms average full replicas. Use algorithm='ddp' (gradients averaged across groups every step) "
            f"with FSDP, or data_parallel='ddp' with {algorithm!r}."
        )
    if use_async_quorum:
        raise FTConfigError(
            "use_async_quorum=True cannot be used with data_parallel='fsdp': an asynchronous quorum reads the "
            "state dict of a live group on another thread while FSDP2 reshards its parameters in the forward pass "
            "(the torchtitan race, torchtitan#4753). Remove use_async_quorum (it defaults to False with FSDP) or "
            "set it to False."
        )
    defaults = _ddp_defaults()
    ddp_only = sorted(
        name
        for name, value in ddp_kwargs.items()
        if name not in _KWARGS_KEPT_WITH_FSDP and not _is_default(name, value, defaults)
    )
    if ddp_only:
        raise FTConfigError(
            f"{', '.join(ddp_only)}: torch DistributedDataParallel setting(s), which do not apply with "
            f"data_parallel='fsdp' (FSDP2 shards the model instead of wrapping it in DDP). Remove "
            f"{'it' if len(ddp_only) == 1 else 'them'}."
        )
    if fsdp_min_params is not None and (
        isinstance(fsdp_min_params, bool) or not isinstance(fsdp_min_params, int) or fsdp_min_params < 1
    ):
        raise FTConfigError(
            f"fsdp_min_params={fsdp_min_params!r}: must be a positive number of parameters, e.g. 1000000 (a module "
            f"with at least that many parameters of its own gets its own fully_shard)."
        )
    if not isinstance(fsdp_cpu_offload, bool):
        raise FTConfigError(f"fsdp_cpu_offload={fsdp_cpu_offload!r}: must be true or false.")
    if fsdp_reshard_after_forward is not None and not isinstance(fsdp_reshard_after_forward, bool):
        raise FTConfigError(
            f"fsdp_reshard_after_forward={fsdp_reshard_after_forward!r}: must be true, false or unset (FSDP2's "
            f"default: true for inner modules, false for the root)."
        )
    return DataParallelSettings(
        data_parallel="fsdp",
        fsdp=FSDPSettings(
            wrap_classes=_wrap_classes(fsdp_wrap),
            min_params=fsdp_min_params,
            mixed_precision=_mixed_precision(fsdp_mixed_precision),
            cpu_offload=fsdp_cpu_offload,
            reshard_after_forward=fsdp_reshard_after_forward,
        ),
    )

"""Streaming DiLoCo's model fragments: which parameters sync together.

A fragment is given either as module names (``[["encoder"], ["decoder", "head"]]``: every parameter under those
modules) or as a number ``k`` (an automatic split into ``k`` contiguous, roughly equal-sized pieces, in module
order). Either way it resolves to disjoint sets of parameter names that together cover every trainable parameter:
a parameter in no fragment would never be synchronised and the replicas would silently drift apart, and one in two
fragments would get two outer steps per period. Tied weights therefore must sit in one fragment.

The shape of the setting is checked when the strategy is built (:func:`check_fragment_spec`); the names, once the
model exists (:func:`resolve_fragments`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_ft.settings import FTConfigError

FragmentSpec = int | Sequence[Sequence[str]]

_SETTING = "fragments"


def check_fragment_spec(spec: FragmentSpec) -> int:
    """Validate the setting's shape and return the number of fragments."""
    if isinstance(spec, bool):
        raise FTConfigError(f"{_SETTING}={spec!r}: give a number of fragments or lists of module names.")
    if isinstance(spec, int):
        if spec < 1:
            raise FTConfigError(f"{_SETTING}={spec}: must be at least 1 (1 = plain DiLoCo, no streaming).")
        return spec
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise FTConfigError(
            f"{_SETTING}={spec!r}: give a number of fragments (fragments=2) or a non-empty list of lists of module "
            f"names (fragments=[['encoder'], ['decoder', 'head']])."
        )
    seen: set[str] = set()
    for index, names in enumerate(spec):
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise FTConfigError(
                f"{_SETTING}[{index}]={names!r}: each fragment is a non-empty list of module names, e.g. ['encoder']."
            )
        for name in names:
            if not isinstance(name, str):
                raise FTConfigError(f"{_SETTING}[{index}]: module name {name!r} is not a string.")
            if name in seen:
                raise FTConfigError(f"{_SETTING}: module {name!r} is listed twice; put each module in one fragment.")
            seen.add(name)
    return len(spec)


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _split_evenly(model: nn.Module, k: int) -> list[list[str]]:
    """Contiguous split of the parameter-owning modules (in module order) into ``k`` pieces of similar size."""
    units: list[tuple[list[str], int]] = []
    for module_name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if params:
            prefix = f"{module_name}." if module_name else ""
            units.append(([prefix + n for n, _ in params], sum(p.numel() for _, p in params)))
    if len(units) < k:
        raise FTConfigError(
            f"{_SETTING}={k}: the model has only {len(units)} modules with trainable parameters, so it cannot be split "
            f"into {k} fragments. Use fragments<={len(units)}."
        )
    total = sum(size for _, size in units)
    fragments: list[list[str]] = [[] for _ in range(k)]
    done = 0
    index = 0
    for position, (names, size) in enumerate(units):
        left_units = len(units) - position
        left_fragments = k - index
        # Move on once this fragment holds its share, but never leave a later fragment empty.
        if fragments[index] and (done >= total * (index + 1) / k or left_units < left_fragments):
            index += 1
        fragments[index].extend(names)
        done += size
    return fragments


def resolve_fragments(model: nn.Module, spec: FragmentSpec) -> list[list[str]]:
    """The parameter names of each fragment: disjoint, and together every trainable parameter of ``model``."""
    count = check_fragment_spec(spec)
    if isinstance(spec, int):
        return _split_evenly(model, count)
    trainable = _trainable(model)
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    fragments: list[list[str]] = []
    for names in spec:
        fragment: list[str] = []
        for module_name in names:
            if module_name not in modules:
                top = sorted(n for n in modules if n and "." not in n)
                raise FTConfigError(
                    f"{_SETTING}: the model has no module {module_name!r}. Top-level modules: {', '.join(top)}."
                )
            prefix = f"{module_name}." if module_name else ""
            for param_name, param in modules[module_name].named_parameters():
                if not param.requires_grad:
                    continue
                if id(param) in owner:
                    raise FTConfigError(
                        f"{_SETTING}: parameter {prefix + param_name!r} is in module {module_name!r} and in "
                        f"{owner[id(param)]!r}; fragments must not overlap (tied weights go in one fragment)."
                    )
                owner[id(param)] = module_name
                fragment.append(prefix + param_name)
        fragments.append(fragment)
    missing = [name for name, p in trainable.items() if id(p) not in owner]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise FTConfigError(
            f"{_SETTING}: parameters {shown} are in no fragment and would never be synchronised. Add their modules to "
            f"a fragment, or use fragments=<number> for an automatic split."
        )
    for index, fragment in enumerate(fragments):
        if not fragment:
            raise FTConfigError(
                f"{_SETTING}[{index}]={list(spec[index])!r}: these modules have no trainable parameters."
            )
    return fragments


def fragment_modules(model: nn.Module, fragments: list[list[str]]) -> list[nn.Module]:
    """One holder module per fragment that shares (not copies) the fragment's parameters, in the shape torchft's
    ``DiLoCo`` expects (it only calls ``named_parameters()`` on a fragment)."""
    params = dict(model.named_parameters())
    holders: list[nn.Module] = []
    for names in fragments:
        holder = nn.Module()
        for name in names:
            holder.register_parameter(name.replace(".", "__"), params[name])
        holders.append(holder)
    return holders

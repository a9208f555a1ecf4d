"""Every private torch name lightning-ft uses, in one module (with :mod:`lightning_ft.manager.listeners`, which binds
Gloo through torch's private process-group API): what it is, why it is used, and what public API would replace it.
A torch upgrade is a diff here; ``tests/package/test_seams.py`` keeps private torch names out of every other module
and checks each has its row in ``PRIVATE_USES``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import _weights_only_unpickler as weights_only_unpickler
from torch.distributed._serialization import _PseudoZipFile as PseudoZipFile
from torch.serialization import _load as load_from_zip_file

__all__ = [
    "PRIVATE_USES",
    "PseudoZipFile",
    "ddp_group_usage",
    "ddp_reduced_parameters",
    "ddp_reduction_pending",
    "fused_copy",
    "load_from_zip_file",
    "nccl_flight_recorder_resettable",
    "non_finite_check_and_unscale",
    "profiler_enabled",
    "rebuild_ddp_buckets",
    "weights_only_unpickler",
]

# One row per private name: why lightning-ft uses it; the public API that would replace it.
PRIVATE_USES = {
    "_weights_only_unpickler": "stream a heal's checkpoint with weights_only=True; a public streaming safe load",
    "_serialization": "the module of _PseudoZipFile (torch.distributed._serialization); same",
    "_PseudoZipFile": "the in-memory zip file of a streamed checkpoint, read once into tensors; same",
    "_load": "torch.load from a zip-file reader (the streamed checkpoint); same",
    "_C": "torch's C extension: the profiler's state, the NCCL flight recorder; public queries of both",
    "_autograd": "torch._C._autograd, for _profiler_enabled; same",
    "_profiler_enabled": "skip torchft's profiler range when no profiler runs; torch.autograd.profiler's state",
    "_distributed_c10d": "torch._C._distributed_c10d, for _reset_fr_recording_nccl; same",
    "_reset_fr_recording_nccl": "whether torchft can reset NCCL's flight recorder (else drop its warning); a "
    "public one",
    "_amp_foreach_non_finite_check_and_unscale_": "the gradient buckets' finite check, fused (GradScaler's kernel)"
    "; a public foreach finite check",
    "_foreach_copy_": "copy the model's buffers to and from one flat tensor, fused; a public foreach copy",
    "_push_all_rebuilt_params": "make DDP rebuild its buckets before the first step, alike in every group; a "
    "public bucket-layout control",
    "_rebuild_buckets": "same",
    "_check_reducer_finalized": "whether DDP reduced every gradient bucket of the backward pass before the step's "
    "vote; a public query of the reducer's state",
    "_build_params_for_reducer": "the parameters DDP reduces, in its reducer's index order (to name one DDP lists by "
    "index, and to find one a group left out); a public list of DDP's reduced parameters",
    "_get_local_used_map": "how many processes of DDP's group used each parameter in the latest reduced backward "
    "pass (a parameter a whole group left out); same",
    # manager/listeners.py: a Gloo process group bound to the advertised address
    "_create_pg": "torchft's ProcessGroupGloo builds its group here (torch's Gloo, bound to one address); a bind "
    "address option",
    "_Options": "ProcessGroupGloo's options, with their device; a public Gloo device option",
    "_timeout": "the options' collective timeout (torchft's, torch's); same",
    "_set_sequence_number_for_group": "as torch's new_group does for a Gloo backend; a public process-group builder",
    "_set_default_backend": "same",
    "_register_backend": "same",
}


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now."""
    return bool(torch._C._autograd._profiler_enabled())


def nccl_flight_recorder_resettable() -> bool:
    """Whether this torch can reset NCCL's flight recorder (torchft resets it at each quorum when it can)."""
    return hasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl")


def non_finite_check_and_unscale(buffers: list[torch.Tensor], found_inf: torch.Tensor, scale: torch.Tensor) -> None:
    """Multiply ``buffers`` by ``scale`` in place, setting ``found_inf`` to 1 if any holds a non-finite value."""
    torch._amp_foreach_non_finite_check_and_unscale_(buffers, found_inf, scale)


def fused_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the target beside it, in one fused operation."""
    torch._foreach_copy_(targets, sources)


def rebuild_ddp_buckets(reducer: Any) -> bool:
    """Make a DDP reducer rebuild its gradient buckets now, from the parameters' registration order; whether it
    did."""
    reducer._push_all_rebuilt_params()
    return bool(reducer._rebuild_buckets())


def ddp_reduction_pending(model: Any) -> str | None:
    """torch's reason if DDP's backward pass left gradient buckets unreduced (a bucket some parameter of which got no
    gradient, with ``find_unused_parameters=False``); ``None`` when every bucket was reduced, or no backward pass
    began since the last reduction. DDP itself raises the same at the next forward pass."""
    try:
        model._check_reducer_finalized()
    except RuntimeError as error:
        return str(error)
    return None


def ddp_reduced_parameters(model: Any) -> list[torch.Tensor]:
    """The parameters DDP ``model`` reduces, in its reducer's index order (the indices of DDP's messages and of
    :func:`ddp_group_usage`): module by module, each module's own trainable parameters that DDP does not ignore, a
    shared one at its first place only."""
    return list(model._build_params_for_reducer()[0])


def ddp_group_usage(model: Any) -> torch.Tensor:
    """With ``find_unused_parameters=True``: for each parameter of :func:`ddp_reduced_parameters`, how many processes
    of DDP's process group used it in the backward passes of the latest reduction (0: the whole group left it out).
    Read after the backward pass: DDP has then waited for this count's allreduce wherever a process left a parameter
    out (elsewhere every count is at least 1 however far the allreduce got)."""
    return model.reducer._get_local_used_map()

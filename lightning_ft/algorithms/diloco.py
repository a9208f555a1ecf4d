"""DiLoCo's sync, built from torchft's streaming DiLoCo fragments.

torchft's ``DiLoCo`` object is created (it allocates each fragment's backup of the global parameters, creates the
fragments and registers each fragment's backup and outer optimizer state with the Manager for healing), but its
context manager is never entered: its optimizer hooks would trigger syncs from an inner-step counter that is not
part of any state dict, so a restarted group would sync at other steps than its peers. Here a sync is triggered by
:class:`~lightning_ft.algorithms.sync_owner.SyncOwner` from ``trainer.global_step``, and runs one fragment's
``prepare_sync()`` (pseudo-gradient allreduce) and ``perform_sync()`` (restore the global parameters, outer step,
mix with the local ones by ``fragment_update_alpha``, commit vote). The fragment is chosen as torchft does, from the
Manager step (which heals), so every group syncs the same fragment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torchft import Manager
from torchft.local_sgd import DiLoCo

from lightning_ft.algorithms.config import AlgorithmSettings
from lightning_ft.algorithms.fragments import fragment_modules, resolve_fragments
from lightning_ft.errors import UnsupportedModelError
from lightning_ft.manager.internals import (
    diloco_fragments,
    fragment_outer_optimizer,
    fragment_updates_off,
    save_global_parameters,
)
from lightning_ft.step.protocol import StepProtocol


class DiLoCoSync:
    """One fit's DiLoCo state: the fragments, their backup (global) parameters and outer optimizers."""

    def __init__(
        self, manager: Manager, module: nn.Module, inner_optimizer: Optimizer, settings: AlgorithmSettings
    ) -> None:
        assert settings.algorithm == "diloco" and settings.outer_optimizer is not None and settings.sync_every
        self.fragment_names = resolve_fragments(module, settings.fragments)
        holders = fragment_modules(module, self.fragment_names)
        outer = [settings.outer_optimizer(holder.parameters()) for holder in holders]
        self._manager = manager
        self._device = next(module.parameters()).device
        self._diloco = DiLoCo(
            manager,
            holders,
            inner_optimizer,
            outer,
            sync_every=settings.sync_every,
            backup_device=None,
            pin_memory=False,
            should_quantize=settings.quantize,
            fragment_sync_delay=settings.fragment_sync_delay,
            fragment_update_alpha=settings.fragment_update_alpha,
        )

    @property
    def outer_optimizers(self) -> list[Optimizer]:
        return [fragment_outer_optimizer(fragment) for fragment in diloco_fragments(self._diloco)]

    @property
    def num_fragments(self) -> int:
        return len(diloco_fragments(self._diloco))

    @contextlib.contextmanager
    def without_update_alpha(self) -> Iterator[None]:
        """Syncs that take the global parameters as they are (the final sync: replicas must end identical)."""
        with fragment_updates_off(diloco_fragments(self._diloco)):
            yield

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs beyond the model: each fragment's global parameters and outer optimizer state
        (healing carries the same through torchft's own ``StreamingDiLoCoFragment_<i>`` entries)."""
        return {
            "fragments": self.fragment_names,
            "global_parameters": [
                {name: t.detach().clone() for name, t in f.original_parameters.items()}
                for f in diloco_fragments(self._diloco)
            ],
            "outer_optimizers": [optimizer.state_dict() for optimizer in self.outer_optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fragments"] != self.fragment_names:
            raise UnsupportedModelError(
                "lightning-ft: the checkpoint's DiLoCo fragments differ from this run's (fragments setting or model "
                "changed); its global parameters and outer optimizer state cannot be restored."
            )
        with torch.no_grad():
            for fragment, saved in zip(diloco_fragments(self._diloco), state["global_parameters"], strict=True):
                for name, tensor in fragment.original_parameters.items():
                    tensor.copy_(saved[name])
        for optimizer, saved in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
            optimizer.load_state_dict(saved)

    def current_fragment(self) -> int:
        """Which fragment the next sync is for: torchft's rule, from the Manager step that every group shares."""
        return self._manager.current_step() % len(diloco_fragments(self._diloco))

    def barrier_before_the_first_vote(self) -> None:
        """The job's first sync: every group is here at Manager step 0, and the quorum's ``init_sync`` made their
        parameters identical, so there is nothing to average; a 4-byte allreduce holds the groups together before the
        vote all the same. A group that heals here fetches its state from a peer's checkpoint server, which torchft
        closes at that peer's vote (Manager.should_commit: disallow_checkpoint). Every other sync allreduces before
        voting, which holds the peers until the healing group is done; without this barrier the source would vote at
        once and the fetch wait out the whole timeout, fail, and the group heal only at the next sync, its first window
        of inner steps thrown away. After the vote, :meth:`reset_global_parameters`."""
        self._manager.allreduce(torch.zeros(1, device=self._device)).wait()

    def reset_global_parameters(self) -> None:
        """Take the current parameters as the global ones (after the ranks of a group were re-aligned, too)."""
        save_global_parameters(self._diloco)

    def prepare(self) -> int:
        """Start the current fragment's sync on the open quorum: compute its pseudo-gradient and issue the
        allreduce without waiting. Returns the fragment's index, for :meth:`perform`.

        With ``fragment_sync_delay`` > 0 the inner steps in between run while the allreduce is in flight; the
        pseudo-gradient is the one taken here."""
        index = self.current_fragment()
        diloco_fragments(self._diloco)[index].prepare_sync()
        return index

    def perform(self, protocol: StepProtocol, index: int) -> bool:
        """Finish fragment ``index``'s sync: average the buffers' change (BatchNorm statistics belong to no fragment),
        wait for the fragment's allreduce, restore its global parameters, vote, and on a commit take the outer step
        and mix in the local parameters by ``fragment_update_alpha``. A sync that does not
        commit leaves the fragment at its global parameters (torchft restores them before the vote), which throws
        away the fragment's inner steps since its last sync."""
        buffers = protocol.buffers  # not part of any fragment: their change is averaged at every sync, before the vote
        if buffers is not None:
            buffers.average()
        committed = diloco_fragments(self._diloco)[index].perform_sync()
        protocol.record_commit(committed)
        if buffers is not None:
            buffers.settle(committed)
        return committed

    def sync(self, protocol: StepProtocol) -> bool:
        """One fragment's whole sync on the open quorum (no overlap)."""
        return self.perform(protocol, self.prepare())

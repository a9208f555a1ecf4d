"""Live state transfer: what a healing replica group receives from a live peer."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_ft.callbacks._access import ft_manager, ft_step_protocol, ft_telemetry, has_step_protocol, is_semi_sync
from lightning_ft.callbacks._batch_hooks import FTCallback
from lightning_ft.heal.state import (
    STATE_KEY,
    align_step_counters,
    apply_training_state,
    capture_training_state,
    check_training_state,
)
from lightning_ft.manager import FTManager
from lightning_ft_job import events

# A child of Lightning's logger, so it prints wherever Lightning's messages do, but on every group: a heal is news
# about this group, and Lightning's rank-zero messages come from group 0 only.
log = logging.getLogger("lightning.pytorch.lightning_ft")


class StateTransferCallback(FTCallback):
    """Registers the whole training state with the torchft Manager for healing.

    The Manager calls :func:`~lightning_ft.heal.state.capture_training_state` on a live peer, on its quorum thread
    (with asynchronous quorum, while the peer's training thread computes the step; with synchronous quorum, while it
    waits for the quorum), and :func:`~lightning_ft.heal.state.apply_training_state` on the healing replica, on the
    training thread, at a safe point (the quorum with synchronous quorum, the commit vote with asynchronous quorum).
    After a heal the replica's step counters jump to the peer's committed step. A state that does not fit this
    replica is refused as soon as it arrives, before this replica's first cross-group collective (see
    :class:`~lightning_ft.manager.FTManager`).

    The model's buffers travel as the sender last committed them (:mod:`lightning_ft.step.buffers`).

    Each heal is timed: applying the state here, receiving it in the transport
    (:mod:`lightning_ft.manager.telemetry`). The ``healed`` event and the ``ft/heal_seconds`` metric carry both.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``: register the training state's save and load functions with this fit's Manager (and, with
        lightning-ft's Manager, the check that refuses a state that does not fit this replica).

        Raises:
            StrategyRequiredError: The strategy has no torchft Manager (not FTStrategy).
        """
        if stage != "fit":
            return
        manager = ft_manager(trainer)  # a new Manager for every fit, so registering once per fit is exactly right
        # Semi-synchronous training: the Manager step counts syncs, not optimizer steps; its owner (SyncOwner)
        # heals the step counters from its own part of the payload.
        steps_follow_manager = not is_semi_sync(trainer)

        buffers = ft_step_protocol(trainer).buffers if has_step_protocol(trainer) else None

        def save() -> dict[str, Any]:
            # The committed buffers: this group's forward pass may be changing the live ones while it sends.
            return capture_training_state(trainer, buffers.committed_state() if buffers is not None else None)

        def load(state: dict[str, Any]) -> None:
            started = time.monotonic()
            apply_training_state(trainer, state)
            if buffers is not None:
                buffers.adopt()  # the buffers just received are the job's committed ones
            step = manager.current_step()
            if steps_follow_manager:
                align_step_counters(trainer, step)
            applied = time.monotonic() - started
            telemetry = ft_telemetry(trainer)
            heal = telemetry.healed(step, applied) if telemetry is not None else None
            # At step 0 a group that started after another takes the job's initial state: no recovery.
            what = "took the job's initial state from a live peer" if step == 0 else "healed from a live peer"
            if heal is not None and heal.receive_seconds is not None:
                log.info(
                    "lightning-ft: %s at committed step %d in %.2f s (received in %.2f s, applied in %.2f s)",
                    what,
                    step,
                    heal.seconds,
                    heal.receive_seconds,
                    heal.apply_seconds,
                )
            else:
                log.info("lightning-ft: %s at committed step %d (applied in %.2f s)", what, step, applied)
            events.emit(
                "healed",
                step=step,
                seconds=heal.seconds if heal is not None else applied,
                receive_seconds=heal.receive_seconds if heal is not None else None,
                apply_seconds=applied,
                source_replica_rank=heal.source_replica_rank if heal is not None else None,
                quorum_id=telemetry.quorum_id if telemetry is not None else None,
            )

        manager.register_state_dict_fn(STATE_KEY, load, save)
        if isinstance(manager, FTManager):  # refuse another model before any collective with the peer
            manager.register_heal_check(STATE_KEY, lambda state: check_training_state(trainer, state))

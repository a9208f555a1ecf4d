"""The heal's view of the strategy's checkpoint methods is the capturing thread's alone."""

from __future__ import annotations

import threading

import torch

from lightning_ft.heal.checkpoint_mode import HealCheckpointMode


def test_the_mode_is_open_only_for_the_thread_that_opened_it():
    """The sender builds a heal on torchft's quorum thread while the training thread computes the step: a checkpoint
    file the training thread saved meanwhile must still get the group's own answer, not the heal's."""
    mode = HealCheckpointMode()
    seen_elsewhere: list[bool] = []
    module = torch.nn.BatchNorm1d(2)
    committed = {"running_mean": torch.full((2,), 7.0)}
    with mode.open(sharded=False, committed_buffers=committed):
        assert mode.is_open
        assert torch.equal(mode.model_state(module.state_dict())["running_mean"], committed["running_mean"])
        other = threading.Thread(target=lambda: seen_elsewhere.append(mode.is_open))
        other.start()
        other.join()
    assert seen_elsewhere == [False]
    assert not mode.is_open
    # closed: the live buffers
    assert torch.equal(mode.model_state(module.state_dict())["running_mean"], torch.zeros(2))

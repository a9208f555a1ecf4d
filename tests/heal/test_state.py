"""The training state handed between replicas: refused when it does not fit, fingerprinted to the bit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, loader, trainer
from lightning.pytorch.callbacks import ModelPruning

from lightning_ft.heal.state import (
    IncompatibleReplicaError,
    apply_training_state,
    capture_training_state,
    check_training_state,
    state_fingerprint,
)


@pytest.fixture(scope="module")
def fitted():
    run = trainer(max_steps=2)
    run.fit(Regressor(), loader())
    return run


def test_round_trip_keeps_the_fingerprint(fitted):
    before = state_fingerprint(fitted)
    apply_training_state(fitted, capture_training_state(fitted))
    assert state_fingerprint(fitted) == before


def test_fingerprint_sees_a_one_bit_change(fitted):
    before = state_fingerprint(fitted)
    weight = fitted.lightning_module.net[0].weight
    with torch.no_grad():
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
    assert state_fingerprint(fitted) != before


def test_a_peer_with_another_model_shape_is_refused(fitted):
    state = capture_training_state(fitted)
    state["state_dict"] = {**state["state_dict"], "net.0.weight": torch.zeros(3, 3)}
    with pytest.raises(IncompatibleReplicaError, match=r"net\.0\.weight"):
        apply_training_state(fitted, state)


def test_a_peer_with_other_parameter_names_is_refused(fitted):
    state = capture_training_state(fitted)
    state["state_dict"] = {f"renamed.{name}": tensor for name, tensor in state["state_dict"].items()}
    with pytest.raises(IncompatibleReplicaError, match="model does not match"):
        apply_training_state(fitted, state)


def test_a_peer_with_other_optimizers_is_refused(fitted):
    state = capture_training_state(fitted)
    state["optimizer_states"] = state["optimizer_states"] * 2
    with pytest.raises(IncompatibleReplicaError, match="2 optimizers"):
        apply_training_state(fitted, state)


def test_a_peer_with_one_renamed_parameter_is_refused_before_anything_loads(fitted):
    """``load_state_dict(strict=True)`` copies every matching tensor before it complains about the others, so the
    names are compared first: a refused state leaves this replica exactly as it was."""
    before = state_fingerprint(fitted)
    state = capture_training_state(fitted)
    model = {name: torch.zeros_like(tensor) for name, tensor in state["state_dict"].items()}
    model["net.0.kernel"] = model.pop("net.0.weight")
    with pytest.raises(
        IncompatibleReplicaError, match=r"only here: 'net\.0\.weight'; .*only on the peer: 'net\.0\.kernel'"
    ):
        apply_training_state(fitted, {**state, "state_dict": model})
    assert state_fingerprint(fitted) == before


def test_checking_a_state_loads_nothing(fitted):
    before = state_fingerprint(fitted)
    state = capture_training_state(fitted)
    state["state_dict"] = {name: torch.zeros_like(tensor) for name, tensor in state["state_dict"].items()}
    check_training_state(fitted, state)
    assert state_fingerprint(fitted) == before


class RoundTripInSecondEpoch(pl.Callback):
    """At the second epoch's first batch (pruning applied at the first epoch's end): capture, then apply."""

    def __init__(self) -> None:
        self.sent: dict | None = None
        self.fingerprints: tuple[str, str] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.current_epoch == 1 and self.sent is None:
            before = state_fingerprint(trainer)
            self.sent = capture_training_state(trainer)
            apply_training_state(trainer, self.sent)
            self.fingerprints = (before, state_fingerprint(trainer))


def test_a_pruned_model_heals_with_its_masks():
    """``ModelPruning`` makes pruning permanent in the checkpoint files it writes (the masks dropped); a heal carries
    the state the group trains, masks and original weights, and loads back into the pruned module."""
    roundtrip = RoundTripInSecondEpoch()
    run = trainer(max_epochs=2, callbacks=[ModelPruning("l1_unstructured", amount=0.5), roundtrip])
    run.fit(Regressor(), loader(n=64))
    assert roundtrip.sent is not None and roundtrip.fingerprints is not None
    assert "net.0.weight_orig" in roundtrip.sent["state_dict"] and "net.0.weight_mask" in roundtrip.sent["state_dict"]
    assert roundtrip.fingerprints[0] == roundtrip.fingerprints[1]

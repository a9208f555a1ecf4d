"""The state a heal benchmark sends (``heal/heal_throughput.py``, ``scale/heal_fanout.py``), and the check that it
arrived: float32 tensors of ``TENSOR_BYTES`` each whose elements are all distinct, so a tensor received into the wrong
place fails the check."""

from __future__ import annotations

from typing import Any

import torch

MB = 1_000_000
TENSOR_BYTES = 4 * MB
FIRST_BITS = 0x3F800000  # 1.0f; counting up from it stays finite (and not NaN) for states below 4.2 GB
MAX_BYTES = 4 * (0x7F800000 - FIRST_BITS)


def make_state(size_bytes: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``size_bytes`` of float32 tensors of ``TENSOR_BYTES`` each, on ``device``; no two elements of the state are
    equal."""
    state: dict[str, torch.Tensor] = {}
    first = FIRST_BITS
    for index, start in enumerate(range(0, size_bytes, TENSOR_BYTES)):
        count = min(TENSOR_BYTES, size_bytes - start) // 4
        bits = torch.arange(first, first + count, dtype=torch.int32)
        state[f"layer{index}.weight"] = bits.view(torch.float32).to(device)
        first += count
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor.nbytes for tensor in state.values())


def check(received: Any, expected: dict[str, torch.Tensor], inplace: dict[str, torch.Tensor] | None) -> None:
    """Raise unless ``received`` holds exactly the sent tensors (and, in place, in the receiver's own tensors)."""
    if not isinstance(received, dict) or received.keys() != expected.keys():
        raise RuntimeError(f"received a state with other keys than the sent one: {type(received)}")
    for key, want in expected.items():
        got = received[key]
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            raise RuntimeError(f"{key}: received {got!r:.80}, sent a {want.dtype} tensor of shape {tuple(want.shape)}")
        if not torch.equal(got, want):
            raise RuntimeError(f"{key}: the received tensor differs from the sent one")
        if inplace is not None and got.data_ptr() != inplace[key].data_ptr():
            raise RuntimeError(f"{key}: not received in place")

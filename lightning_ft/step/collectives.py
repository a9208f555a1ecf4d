"""Job-wide reductions: over every process of every participating replica group.

Lightning reduces logged values (``self.log(..., sync_dist=True)``), torchmetrics states and callback decisions
(``EarlyStopping``, ``ModelCheckpoint``) through the strategy. Under FTStrategy the torch default process group
spans one replica group only, so a plain DDP reduction would give every group its own answer. Here a value first
goes round the group (its own process group), then across groups through the torchft Manager, whose process group
connects equal group ranks of every group in the current quorum.

Everything is built from one primitive, an all-gather: each participant writes its value into its own slot of a
zero buffer and the Manager sums the buffers. The sum of one value and zeros is exact, so every replica receives
the very same bytes, and every reduction (sum, mean, max, min, all, any, torchmetrics' ``cat``) is then computed
locally in one fixed order: every replica ends with bit-identical results. A group that is healing (not
participating in the quorum) contributes nothing, as with gradients, and receives the participants' values.

When cross-group collectives are allowed
----------------------------------------
A cross-group collective is only correct if every group in the quorum makes the same collectives in the same order.
That holds in two kinds of places, and only there:

* **inside an optimizer step**, on the step's own quorum (e.g. ``self.log`` in ``training_step``);
* **in a sync section**: the validation and test loops and the end of a training epoch, which every group reaches at
  the same committed step. A section uses the quorum the groups are already in (the last step's or sync's), as long
  as nothing has failed on it: every group of that quorum is at the section's position, and a group that is just
  restarting is not in it, so it waits for the next training step instead of joining a validation half-way. It
  asks the lighthouse for a quorum of its own (``allow_heal=False``, ``shrink_only=True``: only groups of the previous
  quorum) only when there is none to use or a collective on it failed. The next optimizer step's quorum ends it.

  Not asking the lighthouse matters beyond the round trip: a restarted group waiting at the lighthouse (for its
  peers' next step or sync) makes a ``shrink_only`` quorum form with the first survivor that asks, and then hand the
  next survivor only empty quorums (``tests/manager/test_lighthouse_semantics.py``).

  A section's own quorum may still hold a group that finished the section and went on to its next step (a group
  that died inside the section's last collective made it fail for some survivors only): the quorum's first exchange
  finds the mix, and the attempt fails for everyone in it before anything else is sent
  (:mod:`lightning_ft.manager.quorum_kind`).

Everywhere else (Lightning's one-off dataloader checks, the sanity check, a group that has not joined its first
quorum yet) a reduction stays inside the group, exactly as in plain DDP.

Failure semantics
-----------------
* A peer that dies during a cross-group collective inside a step: the step does not commit anyway; the value falls
  back to this group's own (a warning says so).
* A peer that dies during a sync section: the survivors start a new section quorum without it (after the
  lighthouse's heartbeat timeout) and redo the collective, so the result covers every participating replica. After
  ``max_attempts`` failures the value falls back to this group's own, with a warning. Nothing waits longer than the
  Manager's ``timeout`` per collective and ``quorum_timeout`` per quorum.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp
from torchft import Manager
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_ft.errors import LightningFTError, UnsupportedArgumentError
from lightning_ft.manager.internals import quorum_in_place
from lightning_ft.step.protocol import StepProtocol
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")
T = TypeVar("T")


class CrossGroupCollectiveError(LightningFTError, RuntimeError):
    """A cross-group collective failed: a peer died or timed out. Reported to the Manager as well."""


class CrossGroupCollectives:
    """All-gathers and reductions over every participating replica, inside a group and across groups.

    Args:
        manager: This group's torchft Manager.
        protocol: The fit's step protocol (``None`` for ``validate``/``test``, which have no optimizer steps).
        position: Where this group is (for instance committed step, epoch, batches read); every participant of a
            section must be at the same position, which the section's handshake checks.
        max_attempts: How many section quorums a sync-section collective tries before it falls back to the group's
            own value.
        expected_groups: How many replica groups a section should count (every group of the job); a section quorum
            with fewer is said so, in the log and the event log (``section_partial``): its values cover the data of
            the groups in it only. ``None``: not checked (with spare groups, fewer take part by design).
    """

    def __init__(
        self,
        manager: Manager,
        protocol: StepProtocol | None,
        position: Callable[[], tuple[int, ...]] = lambda: (),
        max_attempts: int = 3,
        expected_groups: int | None = None,
    ) -> None:
        self.manager = manager
        self.protocol = protocol
        self.position = position
        self.max_attempts = max_attempts
        self.expected_groups = expected_groups
        self._handshake_due = False
        # A section is identified by the number of step quorums opened before it: the next step quorum ends it.
        self._section: int | None = None
        self._section_quorum: int | None = None
        self._group_local_depth = 0
        self._says_if_partial = True
        self._warned = False

    # ------------------------------------------------------------------ where collectives may cross groups
    def open_section(self, reduces_data: bool = True) -> None:
        """Every group has reached the same point (an evaluation loop, an epoch end): collectives may cross groups.

        In ``fit``, only a group that has taken part in a step quorum opens sections: a group that restarted and
        has not joined yet is not aligned with the others. ``reduces_data=False``: what the section exchanges
        covers no data (the consistency check's fingerprints), so a section without every group is not said.
        """
        if self.protocol is None or self.protocol.quorums_opened > 0:
            self._section = self._step_quorums()
            self._says_if_partial = reduces_data

    def close_section(self) -> None:
        """End the section now (the next optimizer step's quorum ends it anyway)."""
        self._section = self._section_quorum = None

    def _step_quorums(self) -> int:
        return 0 if self.protocol is None else self.protocol.quorums_opened

    @property
    def _in_section(self) -> bool:
        return self._section is not None and self._section == self._step_quorums()

    @contextlib.contextmanager
    def group_local(self) -> Iterator[None]:
        """Keep reductions inside the group, for collectives that only some groups make (Lightning's dataloader
        length check runs once per process lifetime, so a restarted group would make it alone)."""
        self._group_local_depth += 1
        try:
            yield
        finally:
            self._group_local_depth -= 1

    @property
    def crosses_groups(self) -> bool:
        if self._group_local_depth:
            return False
        if self.protocol is not None and self.protocol.in_step:
            return True
        return self._in_section

    # ------------------------------------------------------------------ public collectives
    def all_gather(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        """Every participating process's ``tensor`` (shapes may differ in size, not in rank), in a fixed order.

        The signature of a torchmetrics ``dist_sync_fn``. An explicit ``group`` keeps the gather on that group.
        """
        tensor = tensor.detach()
        if group is not None:
            return gather_all_tensors(tensor, group)
        local = gather_all_tensors(tensor) if _group_world_size() > 1 else [tensor]
        if not self.crosses_groups:
            return local
        gathered = self._across_groups(lambda: self._gather_uneven(local))
        return local if gathered is None else gathered

    def gather_equal(self, tensor: Tensor) -> Tensor:
        """Stack every participating process's ``tensor`` (same shape everywhere) along a new first dimension."""
        tensor = tensor.detach()
        if _group_world_size() > 1:
            parts = [torch.empty_like(tensor) for _ in range(_group_world_size())]
            dist.all_gather(parts, tensor.contiguous())
            local = torch.stack(parts)
        else:
            local = tensor.unsqueeze(0)
        if not self.crosses_groups:
            return local
        gathered = self._across_groups(lambda: self._slot_gather(local))
        return local if gathered is None else gathered.flatten(0, 1)

    def reduce(self, tensor: Tensor, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Lightning's ``Strategy.reduce`` over every participating process. In place, like DDP's."""
        values = self.gather_equal(tensor)
        reduced = _reduce_stacked(values, reduce_op)
        if reduced.dtype == tensor.dtype:
            return tensor.copy_(reduced)
        return reduced

    def decide(self, decision: bool, require_all: bool) -> bool:
        """A boolean decision that every participating process shares."""
        votes = self.gather_equal(torch.tensor(int(bool(decision)), dtype=torch.int64))
        return bool(votes.all()) if require_all else bool(votes.any())

    # ------------------------------------------------------------------ across groups
    def _across_groups(self, collective: Callable[[], T]) -> T | None:
        """Run ``collective`` across groups on the step's quorum, or on a section quorum with retries.

        Only group rank 0 exchanges with the other groups, then hands the outcome to its group. torchft decides
        participation per group rank (at step 0 with ``init_sync``, rank r of every group follows a different
        group), so ranks exchanging on their own could see different sets of groups; one view per group keeps every
        process of the job on the same answer. Returns ``None`` when the collective failed.
        """
        # A section inside the inner steps that a streaming DiLoCo sync overlaps uses that sync's open quorum: every
        # group is at the same inner step, and a new quorum would reconfigure the process group under the sync.
        in_step = self.protocol is not None and self.protocol.quorum_open
        value: Any = None
        for attempt in range(1 if in_step else self.max_attempts):
            if not in_step and self._section_quorum != self._section:
                if attempt > 0 or not self._quorum_in_place():
                    # shrink_only: only groups of the previous quorum take part, so a restarting group waits for
                    # the next training step rather than joining this section half-way. Outside fit there is no
                    # such group, and the first quorum of a validate/test run must be free to form.
                    self.manager.start_quorum(allow_heal=False, shrink_only=self.protocol is not None)
                self._section_quorum = self._section
                self._handshake_due = True
            outcome: tuple[bool, Any] = (False, None)
            if _group_rank() == 0:
                try:
                    if self._handshake_due and not in_step:
                        self._handshake()
                    outcome = (True, collective())
                except CrossGroupCollectiveError as error:
                    outcome = (False, str(error))
            ok, value = _share_from_group_rank_zero(outcome)
            if ok:
                self._handshake_due = False
                return value
            if in_step:
                self._fall_back(f"a peer failed during a collective inside an optimizer step ({value})")
                return None
            self._section_quorum = None
        self._fall_back(f"{self.max_attempts} section quorums in a row failed (the last one: {value})")
        return None

    def _quorum_in_place(self) -> bool:
        """Whether the section can use the quorum the groups are in. Group rank 0 decides, for the whole group: only
        it exchanges with the other groups, and every rank of a group must ask for a new quorum, or none."""
        usable = quorum_in_place(self.manager) if _group_rank() == 0 else False
        if _group_world_size() > 1:
            usable = bool(_share_from_group_rank_zero((usable, None))[0])
        return usable

    def _fall_back(self, why: str) -> None:
        if not self._warned:
            log.warning(
                "lightning-ft: %s; this value covers this replica group only. Later failures are not reported.", why
            )
            self._warned = True

    def _handshake(self) -> None:
        """The first exchange of every section quorum: each participant's position, in a buffer of an odd number
        of bytes.

        Groups must meet in a section at the same position. Should one be somewhere else (a step that committed in
        one group and not in another, just before a section), the odd length keeps it from pairing with anything
        but another handshake: Gloo refuses an exchange whose sizes differ, so a training step's gradients (whole
        floats) can never be summed with it. Gloo refuses by aborting the receiving process (``EnforceNotMet`` in its
        transport thread), so a section's own quorum never gets that far with a group in a training step: every new
        quorum first checks the kinds of its members (:mod:`lightning_ft.manager.quorum_kind`). A participant at
        another position ends the attempt.
        """
        mine = torch.tensor(list(self.position()), dtype=torch.int64)
        slot = mine.view(torch.uint8)
        manager = self.manager
        manager.wait_quorum()
        slots = manager.num_participants()
        rank = manager.participating_rank()
        buffer = torch.zeros(slots * slot.numel() + 1, dtype=torch.uint8)
        if rank is not None:
            buffer[rank * slot.numel() : (rank + 1) * slot.numel()] = slot
        self._allreduce_sum(buffer)
        if self._says_if_partial:
            self._say_if_partial(slots)
        if slot.numel() == 0 or slots == 0:
            return
        positions = buffer[:-1].clone().reshape(slots, slot.numel()).view(torch.int64)
        expected = positions[0] if rank is None else mine  # a group that is behind only checks the others agree
        for index, other in enumerate(positions):
            if not torch.equal(other, expected):
                raise CrossGroupCollectiveError(
                    f"replica groups are out of step: participant {index} is at {other.tolist()}, "
                    f"expected {expected.tolist()} (committed step, epoch, batches read)"
                )

    def _say_if_partial(self, participants: int) -> None:
        """A section whose quorum lacks some of the job's groups (dead, restarting, cut off): what is reduced in it
        (validation and test metrics, an epoch's torchmetrics) covers the data of the groups in it only. Said once
        per section quorum, by every group's rank 0."""
        expected = self.expected_groups
        if expected is None or participants >= expected:
            return
        log.warning(
            "lightning-ft: %d of %d replica groups take part in this evaluation or epoch end; the others are dead or "
            "restarting. Metrics reduced here (sync_dist, torchmetrics) cover the data of these %d groups only.",
            participants,
            expected,
            participants,
        )
        events.emit(
            "section_partial", participants=participants, replica_groups=expected, step=self.manager.current_step()
        )

    def _allreduce_sum(self, buffer: Tensor) -> None:
        manager = self.manager
        manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
        failure = manager.errored()
        if failure is not None:
            raise CrossGroupCollectiveError(str(failure.original_exception)) from failure.original_exception

    def _slot_gather(self, tensor: Tensor) -> Tensor:
        """``[num_participants, *tensor.shape]``: every participating group's ``tensor``, exact."""
        manager = self.manager
        manager.wait_quorum()
        slots = manager.num_participants()
        mine = manager.participating_rank()
        wire_dtype = torch.float64 if tensor.is_floating_point() else torch.int64
        buffer = torch.zeros((slots, *tensor.shape), dtype=wire_dtype, device=tensor.device)
        if mine is not None:
            buffer[mine] = tensor.to(wire_dtype)
        self._allreduce_sum(buffer)
        return buffer.to(tensor.dtype)

    def _gather_uneven(self, local: list[Tensor]) -> list[Tensor]:
        """Gather this group's tensors (equal rank, any sizes) from every participating group, in slot order."""
        shapes = torch.tensor([list(part.shape) for part in local], dtype=torch.int64).reshape(len(local), -1)
        all_shapes = self._slot_gather(shapes)  # [groups, group size, ndim]
        numels = all_shapes.prod(dim=-1)  # an empty shape (a scalar) has one element
        flat = torch.cat([part.reshape(-1) for part in local])
        padded = torch.zeros(int(numels.sum(dim=-1).max()), dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        all_flat = self._slot_gather(padded)
        gathered: list[Tensor] = []
        for slot in range(all_shapes.shape[0]):
            offset = 0
            for index in range(all_shapes.shape[1]):
                count = int(numels[slot, index])
                shape = [int(size) for size in all_shapes[slot, index]]
                gathered.append(all_flat[slot, offset : offset + count].reshape(shape))
                offset += count
        return gathered


def _group_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _share_from_group_rank_zero(outcome: tuple[bool, Any]) -> tuple[bool, Any]:
    """Group rank 0's outcome on every rank of the group; tensors travel on the CPU and come back where they were."""
    if _group_world_size() == 1:
        return outcome
    ok, value = outcome
    device = _device_of(value)
    payload = [(ok, _to_device(value, torch.device("cpu")))]
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    return ok, _to_device(value, device) if device is not None else value


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, list) and value and isinstance(value[0], Tensor):
        return value[0].device
    return None


def _to_device(value: Any, device: torch.device | None) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


def _reduce_stacked(values: Tensor, reduce_op: ReduceOp | str | None) -> Tensor:
    """Reduce along the first dimension, in one fixed order, as ``torch.distributed`` would name the operation."""
    name = _op_name(reduce_op)
    if name == "sum":
        return values.sum(dim=0)
    if name in ("mean", "avg"):
        return values.sum(dim=0) / values.shape[0]
    if name == "max":
        return values.amax(dim=0)
    if name == "min":
        return values.amin(dim=0)
    if name == "product":
        return values.prod(dim=0)
    raise UnsupportedArgumentError(
        f"lightning-ft: reduce_op={reduce_op!r} is not supported; use 'sum', 'mean', 'max' or 'min'."
    )


def _op_name(reduce_op: ReduceOp | str | None) -> str:
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        return reduce_op.lower()
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if reduce_op == getattr(ReduceOp, name):
            return name.lower()
    raise UnsupportedArgumentError(
        f"lightning-ft: reduce_op={reduce_op!r} is not supported; use 'sum', 'mean', 'max' or 'min'."
    )

"""One job, one contract: every replica group of a job is set up to train the same thing.

The groups of one job are started separately (one torchrun per group, often one host each), each from its own copy
of the configuration. A host whose copy was edited (a longer ``max_steps``, another precision, another accumulation)
would otherwise train as part of the job and end as another model: a group with a higher ``max_steps`` trains on
alone after its peers stop. So the settings that decide what a job trains are compared across groups, and a group
that differs stops before its first step with a :class:`JobContractError` that names each differing setting and both
values.

**What is compared** (:mod:`lightning_ft.start.job_settings`): Lightning's stop conditions, ``max_steps`` first,
accumulation, precision, gradient clipping, the training loader's batch size and length, the validation cadence, the
model's structure, the callbacks whose state Lightning's checkpoint holds, and FTStrategy's own settings that must
agree. Everything else may differ between groups: paths, loggers, progress bars, checkpoint callbacks, timeouts,
addresses (``docs/your-code.md``).

**When** (one rule for every group):

* **At the job's start** (a quorum at committed step 0), every group of the quorum sends its settings to every other
  (:meth:`JobContractCheck.quorum_formed`, as soon as the quorum is known, before the forward pass). A group that
  differs from a strict majority stops; the groups that agree fail that one step, and go on without it. Without a
  strict majority (two groups that disagree) every group stops: nothing can tell which one is right.
* **When a group joins a running job** (a restart, a late start), it heals from a live peer, and the heal carries
  the job's settings beside the training state (:data:`CONTRACT_KEY`). The healing group compares them with its own
  before it loads anything or exchanges anything with its peers (:meth:`JobContractCheck.check_peer`): the live peer
  is part of the job that has been committing steps, so its settings are the job's.

A whole job restarted with a new setting (every group resumed with a longer ``max_steps``) agrees with itself and
goes on.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch

from lightning_ft.manager import FTManager
from lightning_ft.manager.ft_manager import QuorumSeen
from lightning_ft.manager.internals import CROSS_GROUP_SUM, cross_group_process_group
from lightning_ft.start.job_settings import CONTRACT_KEY, JobContract, JobContractError, describe_job
from lightning_ft_job import events

log = logging.getLogger("lightning.pytorch.lightning_ft")


def install_contract_check(
    trainer: pl.Trainer,
    strategy_settings: dict[str, Any],
    manager: FTManager,
    group: int,
    num_groups: int,
) -> JobContractCheck:
    """Compare this group's contract at the job's start (every step-0 quorum) and at every heal."""
    check = JobContractCheck(
        lambda: describe_job(trainer, strategy_settings), manager, group, num_groups, trainer.strategy.root_device
    )
    # Registered before the training state: its check runs first, so a group of another job is told why.
    manager.register_state_dict_fn(CONTRACT_KEY, check.load, check.state)
    manager.register_heal_check(CONTRACT_KEY, check.check_peer)
    manager.add_quorum_observer(check)
    return check


class JobContractCheck:
    """Compares this group's contract with its peers', at the job's start and when this group joins a running job.

    A :class:`~lightning_ft.manager.ft_manager.QuorumObserver` of the group's Manager: it hears of every new quorum
    on the training thread, before anything received in that quorum is vetted or loaded.

    Args:
        describe: This group's contract (:func:`describe_job`), read when first needed and kept.
        manager: The group's Manager.
        group: This group's id.
        num_groups: How many replica groups the job has (every group id is below it).
        device: Where the exchange's buffers live (the cross-group process group's device).
    """

    def __init__(
        self,
        describe: Callable[[], JobContract],
        manager: FTManager,
        group: int,
        num_groups: int,
        device: torch.device,
    ) -> None:
        self._describe = describe
        self._contract: JobContract | None = None
        self.manager = manager
        self.group = group
        self.num_groups = num_groups
        self.device = device

    @property
    def contract(self) -> JobContract:
        if self._contract is None:
            self._contract = self._describe()
        return self._contract

    # ------------------------------------------------------------------ when a group joins a running job
    def state(self) -> dict[str, Any]:
        """What a heal carries beside the training state: the committed step and the job's settings."""
        return {"step": self.manager.current_step(), "group": self.group, "settings": self.contract.settings}

    def load(self, state: dict[str, Any]) -> None:
        """Nothing to load: the settings were compared (:meth:`check_peer`) before the heal went on."""

    def check_peer(self, state: dict[str, Any]) -> None:
        """Raise :class:`JobContractError` if the live peer this group heals from runs another job. Not at committed
        step 0, where the start's vote (:meth:`quorum_formed`) has decided by majority. The model's structure is left
        to the training state's own check, which runs next and names each parameter and both shapes."""
        if int(state["step"]) == 0:
            return
        peer = JobContract(dict(state["settings"]))
        differences = [entry for entry in self.contract.differences(peer) if entry[0] != "model structure"]
        if not differences:
            return
        where = f"the running job (it heals from replica group {state['group']} at committed step {state['step']})"
        self._refuse(differences, where, [int(state["group"])])

    # ------------------------------------------------------------------ at the job's start
    def quorum_waited(self, seconds: float) -> None:
        """Not needed here."""

    def quorum_formed(self, quorum: QuorumSeen) -> None:
        """At a quorum at committed step 0, every group of it compares its contract with every other's, before the
        quorum's heal (``init_sync``) is vetted or loaded and before the forward pass. Every participant of such a
        quorum does: each knows the quorum and the step here (torchft's quorum is waited for before the first forward
        pass at step 0), and hears of each quorum once. A failed exchange decides nothing; the step fails with it, and
        the next quorum votes again.

        When some group differs, that group stops, and the others fail this step and drop the state they may have
        received in it (it may come from that group): the next quorum, without it, starts the job again."""
        mine = self.contract  # read here, on the training thread, before a peer's heal asks for it on another
        manager = self.manager
        if manager.current_step() != 0 or manager.errored() is not None:
            return
        received = self._exchange(mine.to_bytes(self.group))
        if received is None:
            return
        contracts = {group: JobContract.from_bytes(payload)[1] for group, payload in received.items()}
        contracts[self.group] = mine
        odd = self._decide(contracts)
        if odd:
            manager.discard_heal(JobContractError(f"replica group(s) {odd} are set up for another job"))

    def _exchange(self, payload: bytes) -> dict[int, bytes] | None:
        """Every member's payload, by group id, over the quorum's process group: each member fills its own group's
        slot of a zeroed buffer, and a sum gathers them. Every member takes part, a healing one too (torchft's
        ``Manager.allreduce`` zeroes a member that heals in this quorum). ``None`` when the exchange failed, after
        reporting the error to the Manager: the step fails, and the next quorum exchanges again."""
        lengths = torch.zeros(self.num_groups, dtype=torch.int64, device=self.device)
        lengths[self.group] = len(payload)
        if not self._sum(lengths):
            return None
        slots = torch.zeros(self.num_groups, int(lengths.max()), dtype=torch.uint8, device=self.device)
        slots[self.group, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        if not self._sum(slots):
            return None
        host = slots.cpu()
        received = {
            group: host[group, : int(length)].numpy().tobytes()
            for group, length in enumerate(lengths.tolist())
            if length and group != self.group
        }
        try:
            for payload in received.values():
                JobContract.from_bytes(payload)
        except (ValueError, KeyError) as error:  # two members wrote one slot: a group id claimed twice
            self.manager.report_error(RuntimeError(f"the job's start vote exchanged unreadable settings: {error}"))
            return None
        return received

    def _sum(self, tensor: torch.Tensor) -> bool:
        try:
            cross_group_process_group(self.manager).allreduce([tensor], CROSS_GROUP_SUM).wait()
        except Exception as error:  # a member died or timed out: the step fails with it, as any collective's would
            self.manager.report_error(error)
            return False
        return True

    def _decide(self, contracts: dict[int, JobContract]) -> list[int]:
        """The groups that differ from a strict majority; raise if this group is one of them, or if there is none."""
        keys = {group: json.dumps(contract.settings, sort_keys=True) for group, contract in contracts.items()}
        majority_key, count = Counter(keys.values()).most_common(1)[0]
        groups = sorted(keys)
        if count == len(keys):
            events.emit("job_contract", groups=groups, agreed=True)
            return []
        if count * 2 <= len(keys):
            events.emit("job_contract", groups=groups, agreed=False, odd=groups, majority=False)
            others = [group for group in groups if keys[group] != keys[self.group]]
            where = f"replica group(s) {others}, and no majority can tell which is right (every group stops)"
            self._refuse(self.contract.differences(contracts[others[0]]), where, others)
        majority = [group for group in groups if keys[group] == majority_key]
        odd = [group for group in groups if keys[group] != majority_key]
        events.emit("job_contract", groups=groups, agreed=False, odd=odd, majority=True)
        if self.group in odd:
            where = f"replica group(s) {majority}, the majority of the job's first quorum"
            self._refuse(self.contract.differences(contracts[majority[0]]), where, majority)
        log.error(
            "lightning-ft: replica group(s) %s are set up for another job than this one and stop; this step fails, "
            "and the job goes on with the groups that agree (%s).",
            odd,
            majority,
        )
        return odd

    def _refuse(self, differences: list[tuple[str, str, str]], where: str, peers: Iterable[int]) -> NoReturn:
        named = "; ".join(f"{name} is {mine} here and {theirs} there" for name, mine, theirs in differences)
        events.emit(
            "contract_refused",
            peers=list(peers),
            differences=[{"setting": name, "here": mine, "there": theirs} for name, mine, theirs in differences],
        )
        raise JobContractError(
            f"lightning-ft: replica group {self.group} is set up for another job than {where}: {named}. Every group "
            f"of one job must agree on these settings (docs/your-code.md, 'What every group must agree on'): fix "
            f"this group's configuration, or restart every group with the new one. This group stops before its "
            f"first step."
        )

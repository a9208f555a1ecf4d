"""A new quorum's members first check that they all asked for one kind of quorum (lightning_ft.manager.quorum_kind).

The real case: two processes with real Managers against a real lighthouse that needs both, one retrying a sync
section, the other in its next training step: they meet in one quorum. Without the check the section's member sends
its handshake and the step's member its gradients as the new process group's first collective, and Gloo aborts the
section's process (SIGABRT, ``EnforceNotMet``: the soak's survivor that died with the group killed beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from harness import REPO, WORKERS

from lightning_ft.manager.ft_manager import QuorumSeen
from lightning_ft.manager.quorum_kind import MixedQuorumError, QuorumKindCheck
from lightning_ft_job.lighthouse_server import start_lighthouse


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_section_and_a_step_in_one_quorum_both_fail_it_and_neither_process_dies():
    lighthouse = start_lighthouse(min_replicas=2)  # neither request forms a quorum alone: they meet
    worker = str(WORKERS / "mixed_quorum_worker.py")
    processes = [
        subprocess.Popen(
            [sys.executable, worker, role, str(group), lighthouse.address],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for group, role in enumerate(("section", "step"))
    ]
    try:
        outputs = [process.communicate(timeout=150) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        lighthouse.shutdown()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, f"{process.args[2]} exited {process.returncode}:\n{stderr[-4000:]}"
    section, step = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs)
    # Neither value crossed groups: the section falls back to its group's own value, the step's gradient stays its own
    # (the step does not commit).
    assert section == {"role": "section", "value": 1.0, "error": "MixedQuorumError"}, section
    assert step == {"role": "step", "value": 2.0, "error": "MixedQuorumError"}, step


class _Work:
    def wait(self) -> bool:
        return True


class _SummingGroup:
    """A process group of several fake members whose allreduce adds the others' contributions, recorded."""

    def __init__(self, others: torch.Tensor) -> None:
        self.others = others
        self.exchanges = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.exchanges += 1
        tensors[0].add_(self.others)
        return _Work()


class _Manager:
    def __init__(self, others: torch.Tensor, may_heal: bool) -> None:
        self._pg = _SummingGroup(others)
        self.latest_request_may_heal = may_heal
        self.errors: list[Exception] = []

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)

    def current_step(self) -> int:
        return 12


@pytest.mark.parametrize(
    ("others", "may_heal", "mixed"),
    [
        ([0, 2], True, False),  # three steps
        ([2, 0], False, False),  # three sections
        ([1, 1], True, True),  # a step among a section and a step
        ([0, 1], False, True),  # a section among steps
    ],
)
def test_each_new_quorum_id_is_checked_once_and_a_mix_of_kinds_fails_it(others, may_heal, mixed):
    manager = _Manager(torch.tensor(others), may_heal)
    check = QuorumKindCheck(manager, torch.device("cpu"))  # type: ignore[arg-type]
    for quorum_id in (3, 3, 3):  # the same quorum, heard of at every step: one process group, one exchange
        check.quorum_formed(QuorumSeen(quorum_id=quorum_id, participants=3, replica_rank=0))
    assert manager._pg.exchanges == 1
    assert [type(error) for error in manager.errors] == ([MixedQuorumError] if mixed else [])
    check.quorum_formed(QuorumSeen(quorum_id=4, participants=3, replica_rank=0))
    assert manager._pg.exchanges == 2, "a new quorum id is a new process group: checked again"

"""A replica group that leaves a parameter out of a training step's loss (a branch not taken, a layer skipped for
one batch): every group applies the job's average gradient to it, so the job stays one model, whatever
``find_unused_parameters`` says.

What each way of handling it catches (:mod:`lightning_ft.step.left_out_parameters`): with DDP's search (``True``),
DDP alone leaves a parameter its whole process group left out untouched (its gradient ``None``) while the groups
that used it apply the cross-group average: the replicas part at that step (measured: the replica consistency check
stopped the job, ``exp_avg`` and the bias differ). Without the search (``False``, and the default ``None`` on this
one-bucket MLP), DDP never reduces the bucket that holds the parameter: each group would commit its own gradients
(measured at the sixteenth session), or stop.

With HSDP (``data_parallel="fsdp"``, :mod:`lightning_ft.hsdp.cross_group`) the same rule holds for a whole
``fully_shard`` module left out. What it catches: FSDP2 reduces nothing for such a module, so with FSDP2's
all-reduce hook alone (lightning-ft's before) the dropping group made one cross-group collective fewer, the
collectives paired up wrongly, and Gloo aborted a group (measured on this test's HSDP cases: ``528 vs 272 ...
Received data size doesn't match``; the other group finished alone).

Real jobs (a real lighthouse, torchrun groups); at one global step, in one group or in both, the worker's last layer
leaves its bias out of the loss (DDP, groups of one process), or its residual branch, a ``fully_shard`` module of
its own, is skipped (HSDP, groups of two processes, a ``fully_shard`` per Linear). Generated: each setting
(``None``, ``True``, ``False``, and HSDP); every group as the one that leaves it out and as the one that keeps it,
and both; the first, a middle and the last step; with ``True``, gradients as views of DDP's buckets (FTStrategy's
default) and as copies (``gradient_as_bucket_view=False``, where DDP's count of the group's uses tells what was left
out). Each asserts every step committed with both groups, two bit-identical replicas at ``max_steps`` (with HSDP,
each group's full state), and the replay in one process: the mean loss over every process's batch, the dropping
groups' without the bias or the branch, with plain SGD (a wrong scale shows). Where every group leaves it out, the
rule gives it a zero gradient (DDP alone would leave it ``None``): those cases train with AdamW, whose step count and
weight decay show the difference, and the replay applies the same rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MAX_STEPS = 12
GROUPS = 2
SEED, LR = 5, 0.1
# FTStrategy(find_unused_parameters=...) with DDP; "hsdp": data_parallel="fsdp", where the search does not apply.
SETTINGS = {"default": None, "search": 1, "no-search": 0, "hsdp": None}
HSDP = ["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0", "--branch"]
CASES = [
    (setting, dropping, step, view)
    for setting in SETTINGS
    for view in ((True, False) if setting == "search" else (True,))
    for dropping in ((0,), (1,), (0, 1))
    for step in (0, 6, MAX_STEPS - 1)
]
# `make test` (close to its 20-minute budget) runs one (each way is checked in process in test_gradient_hooks.py);
# `make test-extra` all.
IN_MAKE_TEST = {("default", (1,), 6, True), ("hsdp", (0,), 6, True)}


@pytest.mark.parametrize(
    ("setting", "dropping", "step", "view"),
    [
        pytest.param(
            *case,
            marks=() if case in IN_MAKE_TEST else pytest.mark.paths,
            id=f"{case[0]}-groups{''.join(map(str, case[1]))}-step{case[2]}-{'views' if case[3] else 'copies'}",
        )
        for case in CASES
    ],
)
def test_a_parameter_left_out_by_a_group_gets_the_jobs_average(
    launch, setting: str, dropping: tuple[int, ...], step: int, view: bool
) -> None:
    optimizer = "adamw" if len(dropping) == GROUPS else "sgd"  # plain SGD steps a zero gradient as a missing one
    ranks = 2 if setting == "hsdp" else 1
    job = launch(
        groups=GROUPS,
        nproc_per_group=ranks,
        worker_args=[
            f"--max-steps={MAX_STEPS}",
            f"--optimizer={optimizer}",
            f"--lr={LR}",
            f"--seed={SEED}",
            "--index-data=4096",
            f"--gradient-as-bucket-view={int(view)}",
            *([] if SETTINGS[setting] is None else [f"--find-unused-parameters={SETTINGS[setting]}"]),
            f"--unused-bias-at-step={step}",
            f"--unused-bias-groups={','.join(map(str, dropping))}",
            *(HSDP if setting == "hsdp" else []),
            *GATES,
        ],
    )
    start_together(job, groups=GROUPS, nproc=ranks)
    assert job.wait_exit() == 0, job.tail()
    committed = job.events("step", committed=True)
    assert all(event["participants"] == GROUPS for event in committed), f"a group sat a step out\n{job.tail()}"

    states = job.final_states()
    assert sorted(states) == [(group, 0) for group in range(GROUPS)], job.tail()  # HSDP: rank 0's full state
    for key, state in states.items():
        assert state["manager_step"] == MAX_STEPS, f"{key}: manager step {state['manager_step']} != {MAX_STEPS}"
    assert_bit_identical(states, GROUPS)

    expected = _replay(job, dropping, step, optimizer, ranks)
    model = states[(0, 0)]["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(model[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _replay(
    job: LaunchedJob, dropping: tuple[int, ...], dropped_step: int, name: str, ranks: int
) -> dict[str, torch.Tensor]:
    """One process, the worker's optimizer and schedule: at each committed step the mean loss over every process's
    batch, a dropping group's without the last layer's bias, or with HSDP without the branch (a zero gradient for
    what no group used)."""
    from workers.train_worker import Regressor, dataset

    torch.manual_seed(SEED)
    reference = Regressor(lr=LR, optimizer=name, branch=ranks > 1)
    parameters = reference.parameters()
    optimizer = torch.optim.SGD(parameters, lr=LR) if name == "sgd" else torch.optim.AdamW(parameters, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    data = dataset(4096)
    for step in range(MAX_STEPS):
        losses = []
        for group in range(GROUPS):
            for rank in range(ranks):
                records = job.events("batch", group=group, rank=rank, step=step + 1, committed=True)
                assert len(records) == 1, f"group {group}, rank {rank}, step {step}: {records}"
                x, y = data[records[0]["ids"]]
                left_out = group in dropping and step == dropped_step
                losses.append(torch.nn.functional.mse_loss(_prediction(reference, x, left_out), y))
        optimizer.zero_grad()
        (sum(losses) / len(losses)).backward()
        for parameter in reference.parameters():
            if parameter.grad is None:  # every group left it out
                parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        scheduler.step()
    return {name: tensor for name, tensor in reference.state_dict().items() if name.startswith(("net.", "branch."))}


def _prediction(reference: Any, x: torch.Tensor, left_out: bool) -> torch.Tensor:
    """The worker's forward pass (``Regressor.training_step``): without the branch, or the last layer's bias."""
    last = reference.net[-1]
    if reference.branch is not None:
        features = reference.net[:-1](x)
        return last(features if left_out else features + reference.branch(features))
    if left_out:
        return torch.nn.functional.linear(reference.net[:-1](x), last.weight)
    return reference.net(x)

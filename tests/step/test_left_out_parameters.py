"""A replica group that leaves a parameter out of a training step's loss (a branch not taken, a layer skipped for
one batch): every group applies the job's average gradient to it, so the job stays one model, whatever
``find_unused_parameters`` says.

What each way of handling it catches (:mod:`lightning_ft.step.left_out_parameters`): with DDP's search (``True``),
DDP alone leaves a parameter its whole process group left out untouched (its gradient ``None``) while the groups
that used it apply the cross-group average: the replicas part at that step (measured: the replica consistency check
stopped the job, ``exp_avg`` and the bias differ). Without the search (``False``, and the default ``None`` on this
one-bucket MLP), DDP never reduces the bucket that holds the parameter: each group would commit its own gradients
(measured at the sixteenth session), or stop.

Real jobs (a real lighthouse, torchrun groups of one process); the worker's last layer leaves its bias out of the
loss at one global step, in one group or in both. Generated: each setting (``None``, ``True``, ``False``); every
group as the one that leaves it out and as the one that keeps it, and both; the first, a middle and the last step;
with ``True``, gradients as views of DDP's buckets (FTStrategy's default) and as copies
(``gradient_as_bucket_view=False``, where DDP's count of the group's uses tells what was left out). Each asserts
every step committed with both groups, two bit-identical replicas at ``max_steps``, and the replay in one process:
the average over both groups' mean losses, the dropping groups' without the bias, with plain SGD (a wrong scale
shows). Where every group leaves the bias out, the rule gives it a zero gradient (DDP alone would leave it
``None``): those cases train with AdamW, whose step count and weight decay show the difference, and the replay
applies the same rule.
"""

from __future__ import annotations

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MAX_STEPS = 12
GROUPS = 2
SEED, LR = 5, 0.1
SETTINGS = {"default": None, "search": 1, "no-search": 0}  # FTStrategy(find_unused_parameters=...)
CASES = [
    (setting, dropping, step, view)
    for setting in SETTINGS
    for view in ((True, False) if setting == "search" else (True,))
    for dropping in ((0,), (1,), (0, 1))
    for step in (0, 6, MAX_STEPS - 1)
]
# `make test` (close to its 20-minute budget) runs one (each way is checked in process in test_gradient_hooks.py);
# `make test-extra` all.
IN_MAKE_TEST = {("default", (1,), 6, True)}


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
    job = launch(
        groups=GROUPS,
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
            *GATES,
        ],
    )
    start_together(job, groups=GROUPS, nproc=1)
    assert job.wait_exit() == 0, job.tail()
    committed = job.events("step", committed=True)
    assert all(event["participants"] == GROUPS for event in committed), f"a group sat a step out\n{job.tail()}"

    states = job.final_states()
    assert sorted(states) == [(group, 0) for group in range(GROUPS)], job.tail()
    for key, state in states.items():
        assert state["manager_step"] == MAX_STEPS, f"{key}: manager step {state['manager_step']} != {MAX_STEPS}"
    assert_bit_identical(states, GROUPS)

    expected = _replay(job, dropping, step, optimizer)
    model = states[(0, 0)]["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(model[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _replay(job: LaunchedJob, dropping: tuple[int, ...], dropped_step: int, name: str) -> dict[str, torch.Tensor]:
    """One process, the worker's optimizer and schedule: at each committed step the mean of both groups' mean losses
    on the samples each group trained on, a dropping group's without the last layer's bias (a zero gradient for it
    when no group used it)."""
    from workers.train_worker import Regressor, dataset

    torch.manual_seed(SEED)
    reference = Regressor(lr=LR, optimizer=name)
    parameters = reference.parameters()
    optimizer = torch.optim.SGD(parameters, lr=LR) if name == "sgd" else torch.optim.AdamW(parameters, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    data = dataset(4096)
    last = reference.net[-1]
    for step in range(MAX_STEPS):
        losses = []
        for group in range(GROUPS):
            records = job.events("batch", group=group, rank=0, step=step + 1, committed=True)
            assert len(records) == 1, f"group {group}, step {step}: {records}"
            x, y = data[records[0]["ids"]]
            if group in dropping and step == dropped_step:
                prediction = torch.nn.functional.linear(reference.net[:-1](x), last.weight)
            else:
                prediction = reference.net(x)
            losses.append(torch.nn.functional.mse_loss(prediction, y))
        optimizer.zero_grad()
        (sum(losses) / GROUPS).backward()
        if last.bias.grad is None:  # every group left it out
            last.bias.grad = torch.zeros_like(last.bias)
        optimizer.step()
        scheduler.step()
    return {name: tensor for name, tensor in reference.state_dict().items() if name.startswith("net.")}

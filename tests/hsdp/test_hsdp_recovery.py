"""HSDP with real processes: 2 replica groups × 2 processes, FSDP2 over gloo inside each group, torchft across.

Real lighthouse, real torchrun restarts via ``lightning-ft launch``, real SIGKILL by PID. Every group writes its full
(unsharded) model and optimizer state at the end, gathered with torch's ``get_model_state_dict`` /
``get_optimizer_state_dict``, and those are compared across groups bit for bit.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from harness import LaunchedJob, assert_bit_identical
from test_checkpoints import load, manager_state, saves
from test_fault_tolerance import GATES, assert_outcome, kill_and_restart, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(480)]

HSDP = ["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0"]


@pytest.mark.parametrize("transport", ["http", pytest.param("pg", marks=[pytest.mark.compat, pytest.mark.paths])])
def test_sigkill_one_rank_its_group_restarts_heals_sharded_state_and_rejoins(launch, transport):
    """One rank of group 1 is SIGKILLed: its whole group restarts (fresh store), heals its shards from group 0's
    same-rank processes, and rejoins; every group ends with the same full parameters and optimizer state. With
    gradient accumulation (no reduction on the first micro-batch) and clipping (a norm over DTensor shards)."""
    max_steps = 40
    job = launch(
        groups=2,
        nproc_per_group=2,
        worker_args=[
            f"--max-steps={max_steps}",
            f"--transport={transport}",
            "--accumulate=2",
            "--clip=0.5",
            *HSDP,
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=2)
    kill_and_restart(job, victim=1, rank=1, survivor=0, nproc=2)
    assert_outcome(job, restarted=1, max_steps=max_steps, replicas=2)  # one full state per group
    restarted_rank1 = job.worker_pid(1, 1)
    heals = job.events("healed", group=1, rank=1, pid=restarted_rank1)
    assert heals and heals[0]["step"] > 0, "rank 1 of the restarted group never healed its shard"
    for group in (0, 1):
        assert len(job.events("finished", group=group)) == 2


def global_batches(job: LaunchedJob, steps: int) -> list[list[int]]:
    """The sample ids every rank of every group trained on at each committed step (one batch per step)."""
    batches = []
    for step in range(1, steps + 1):
        ids = []
        for group in (0, 1):
            for rank in (0, 1):
                records = job.events("batch", group=group, rank=rank, step=step)
                assert len(records) == 1, f"group {group} rank {rank} step {step}: {records}"
                ids.extend(records[0]["ids"])
        batches.append(ids)
    return batches


def test_hsdp_steps_equal_single_process_steps_on_the_global_batch(launch):
    """Reduce-scatter inside the group plus the Manager's average across groups is the mean gradient over the
    global batch: three SGD steps of 2 groups × 2 processes equal three single-process steps on the 64 samples the
    four processes trained on (up to float summation order)."""
    from workers.train_worker import Regressor, dataset

    steps, seed, lr = 3, 7, 0.1
    job = launch(
        groups=2,
        nproc_per_group=2,
        worker_args=[
            f"--max-steps={steps}",
            "--optimizer=sgd",
            f"--lr={lr}",
            f"--seed={seed}",
            "--index-data=4096",
            *HSDP,
            *GATES,
        ],
    )
    start_together(job, groups=2, nproc=2)
    assert job.wait_exit() == 0, job.tail()
    assert all(record["participants"] == 2 for record in job.events("step", committed=True)), "a group sat out"

    torch.manual_seed(seed)
    reference = Regressor(lr=lr, optimizer="sgd")
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    data = dataset(4096)
    for ids in global_batches(job, steps):
        x, y = data[ids]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference.net(x), y).backward()
        optimizer.step()
    expected = {name: tensor for name, tensor in reference.state_dict().items() if name.startswith("net.")}

    states = job.final_states()
    assert sorted(states) == [(0, 0), (1, 0)]
    assert_bit_identical(states, replicas=2)  # FSDP: each group's rank 0 writes the full state
    model = states[(0, 0)]["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(model[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# The DDP path of this scenario runs in `make test` (test_one_job.py, every group killed at once resumes from the
# newest checkpoint); this one, sharded, in `make test-extra`.
@pytest.mark.paths
def test_kill_every_group_then_resume_sharded_state_from_last_checkpoint(launch, tmp_path):
    """Checkpoints of sharded state follow the single-writer rule (the writing group gathers the full state, its
    rank 0 writes one file); every process of a new job reads it and re-shards it, and training continues at the
    checkpoint's step on every group."""
    ckpt_dir = tmp_path / "checkpoints"
    max_steps = 30
    common = [f"--max-steps={max_steps}", f"--ckpt-dir={ckpt_dir}", "--ckpt-every=5", *HSDP, *GATES]
    first = launch("first", groups=2, nproc_per_group=2, worker_args=common)
    start_together(first, groups=2, nproc=2)
    first.wait_for(
        "last.ckpt at step 10",
        lambda: [r for r in saves(first) if r["path"].endswith("last.ckpt") and r["step"] >= 10],
    )
    for group in (0, 1):
        workers = [first.started(group, rank) for rank in (0, 1)]
        os.kill(workers[0]["ppid"], signal.SIGKILL)  # the torchrun agent first, so that nothing restarts the group
        for worker in workers:
            os.kill(worker["pid"], signal.SIGKILL)
    assert first.wait_exit() == 1

    saved = load(ckpt_dir / "last.ckpt")
    saved_step = saved["global_step"]
    assert saved_step >= 10 and saved_step % 5 == 0 and manager_state(saved)["step"] == saved_step
    assert saved["state_dict"]["net.0.weight"].shape == (32, 16), "the checkpoint must hold the full parameters"

    resumed = launch("resumed", groups=2, nproc_per_group=2, worker_args=[*common, "--resume"])
    start_together(resumed, groups=2, nproc=2)
    assert resumed.wait_exit() == 0, resumed.tail()
    for group in (0, 1):
        for rank in (0, 1):
            first_step = resumed.committed_steps(group, rank=rank)[0]
            assert first_step == saved_step + 1, f"group {group} rank {rank} resumed at {first_step}"
    assert not resumed.events("healed"), "groups resumed from the same checkpoint must not need healing"
    states = resumed.final_states()
    for key, state in states.items():
        assert state["global_step"] == state["manager_step"] == max_steps, key
    assert_bit_identical(states, replicas=2)  # FSDP: each group's rank 0 writes the full state

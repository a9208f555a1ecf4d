"""What the replica consistency check costs, against a training step of the same model: the figure that sets how
often FTStrategy's default check runs (``ReplicaConsistencyCheck(every_n_steps=...)``).

A check fingerprints the whole state a heal carries (:func:`lightning_ft.heal.fingerprint.state_fingerprints`:
Lightning's checkpoint built in memory, every tensor summed as 32-bit words) and all-gathers a few hundred bytes per
group. This measures, in one process and one run, on one fitted Trainer (an MLP of ``--params`` million float32
parameters with AdamW: three times that in state), interleaved repetition by repetition:

* ``check``: building the state and fingerprinting it (the all-gather of its JSON, about 1 kB, is left out: one small
  collective on the step's quorum);
* ``step``: one optimizer step of the same model on a batch of ``--batch`` rows (forward, backward, AdamW).

The verdict is ``check / step``: a check every N steps costs ``100 × ratio / N`` percent of the training time, so N
must be at least ``100 × ratio`` for the check to stay under 1%.
Usage::

    python -m benchmarks.heal.state_check_cost                 # 1, 10 and 25 M parameters, a new results file
    python -m benchmarks.heal.state_check_cost --params 10 --batch 64 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks.common.results import header, new_results_file
from benchmarks.heal.heal_state_cost import fitted_trainer
from lightning_ft.heal.fingerprint import state_fingerprints


def one_check(trainer: pl.Trainer) -> float:
    started = time.perf_counter()
    state_fingerprints(trainer, synced_buffers=set())
    return time.perf_counter() - started


def one_step(trainer: pl.Trainer, batch: torch.Tensor) -> float:
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    started = time.perf_counter()
    loss = module.training_step((batch,), 0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def measure(params_millions: float, batch_rows: int, repeats: int) -> dict[str, object]:
    trainer = fitted_trainer(params_millions)
    batch = torch.randn(batch_rows, trainer.lightning_module.width)
    one_step(trainer, batch)  # warm
    checks, steps = [], []
    for _ in range(repeats):
        checks.append(one_check(trainer))
        steps.append(one_step(trainer, batch))
    check, step = statistics.median(checks), statistics.median(steps)
    ratio = check / step
    return {
        "params_millions": params_millions,
        "batch": batch_rows,
        "check_s": checks,
        "step_s": steps,
        "median_check_s": check,
        "median_step_s": step,
        "check_over_step": ratio,
        "min_every_n_steps_for_1_percent": math.ceil(100 * ratio),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, nargs="+", default=[1.0, 10.0, 25.0], help="millions of parameters")
    parser.add_argument("--batch", type=int, default=32, help="rows per training batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("LIGHTNING_FT_EVENTS_DIR", "")  # no event log for an in-process benchmark
    torch.set_num_threads(1)
    sizes = [measure(params, args.batch, args.repeats) for params in args.params]
    result = {**header(), "repeats": args.repeats, "sizes": sizes}
    out = new_results_file("state_check_cost", args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for size in sizes:
        print(
            f"{size['params_millions']:>5} M params, batch {size['batch']}: "
            f"check {size['median_check_s'] * 1e3:.1f} ms, "
            f"step {size['median_step_s'] * 1e3:.1f} ms, check/step {size['check_over_step']:.3f}: every "
            f"{size['min_every_n_steps_for_1_percent']} steps or more stays under 1%"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

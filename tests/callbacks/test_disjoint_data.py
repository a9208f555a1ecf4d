"""DisjointDataCheck: two groups that read the same first batch are named; a one-group fit has nothing to compare.
(Groups of a real job reading one dataset unsharded: tests/strategy/test_your_code.py.)"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import pytest
import torch
from helpers import Regressor, loader
from helpers import trainer as make_trainer

from lightning_ft import FTStrategy
from lightning_ft.callbacks import DisjointDataCheck
from lightning_ft.callbacks.disjoint_data import batch_digest, duplicated_groups

pytestmark = pytest.mark.timeout(120)


def test_groups_with_equal_first_batches_at_the_same_rank_are_named():
    same, other = batch_digest((torch.ones(4), torch.zeros(4))), batch_digest((torch.ones(4), torch.ones(4)))
    assert same is not None and other is not None and same != other
    rows = [(0, 0, 1, *same), (1, 0, 1, *same), (2, 0, 1, *other), (0, 1, 1, *other), (1, 1, 1, *same)]
    assert duplicated_groups(rows) == [(0, 0, 1)]
    assert duplicated_groups([(0, 0, 0, 0, 0), (1, 0, 0, 0, 0)]) == [], "batches without tensors prove nothing"
    assert batch_digest({"ids": [1, 2]}) is None


@pytest.mark.parametrize("seed", range(20))
def test_every_pair_of_groups_with_one_batch_at_one_rank_is_found_and_no_other(seed):
    """Seeded jobs of 2 to 6 groups of 1 to 3 ranks, each (group, rank) reading one of a few batches, in any row
    order: each group that reads at a rank what a lower group read there is paired with the lowest such group."""
    rng = random.Random(seed)
    groups, ranks = rng.randint(2, 6), rng.randint(1, 3)
    batches = [batch_digest(torch.full((4,), float(value))) for value in range(rng.randint(1, 4))]
    reads = {(g, r): rng.randrange(len(batches)) for g in range(groups) for r in range(ranks)}
    rows = [(g, r, 1, *batches[b]) for (g, r), b in reads.items()]
    rng.shuffle(rows)
    wanted = sorted(
        (r, min(h for h in range(g) if reads[h, r] == reads[g, r]), g)
        for (g, r) in reads
        if any(reads[h, r] == reads[g, r] for h in range(g))
    )
    assert sorted(duplicated_groups(rows)) == wanted


class FirstBatchIsGathered(pl.Callback):
    def __init__(self) -> None:
        self.gathers = 0

    def setup(self, trainer, pl_module, stage) -> None:
        collectives = trainer.strategy.collectives
        gather = collectives.all_gather

        def counted(tensor):
            self.gathers += 1
            return gather(tensor)

        collectives.all_gather = counted


@pytest.mark.usefixtures("one_group_environment")
def test_a_one_group_fit_settles_without_a_collective_or_a_warning(tmp_path):
    check, gathers = DisjointDataCheck(), FirstBatchIsGathered()
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20), [check, gathers], max_steps=3, default_root_dir=tmp_path
    )
    trainer.fit(Regressor(), loader())
    assert not check.warned and gathers.gathers == 0

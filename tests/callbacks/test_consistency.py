"""ReplicaConsistencyCheck on its own: its settings, when it runs in a one-group fit, and the fit it refuses. (A real
divergence between groups, found and healed, is tests/callbacks/test_failure_injection.py's.)"""

from __future__ import annotations

import pytest
from helpers import Regressor, loader
from helpers import trainer as make_trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ft import FTConfigError, FTStrategy, ReplicaConsistencyCheck

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_group_environment")]


@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"every_n_steps": 2.5}, "every_n_steps=2.5"),
        ({"on_divergence": "x"}, "on_divergence='x'"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(arguments, names):
    with pytest.raises(FTConfigError, match=names):
        ReplicaConsistencyCheck(**arguments)


@pytest.mark.parametrize(("max_steps", "every", "checks"), [(6, 2, 3), (7, 3, 3), (1, 5, 1)])
def test_it_checks_every_n_committed_steps_and_the_last(tmp_path, max_steps, every, checks):
    check = ReplicaConsistencyCheck(every_n_steps=every)
    trainer = make_trainer(
        FTStrategy(timeout=20, quorum_timeout=20), [check], max_steps=max_steps, default_root_dir=tmp_path
    )
    trainer.fit(Regressor(), loader())
    assert check.checks == checks  # steps every, 2 every, ...; the last step too, when it is not one of them


def test_a_semi_synchronous_fit_is_refused(tmp_path):
    strategy = FTStrategy(algorithm="local_sgd", sync_every=2)
    trainer = make_trainer(strategy, [ReplicaConsistencyCheck()], max_steps=2, default_root_dir=tmp_path)
    with pytest.raises(FTConfigError, match="algorithm='ddp' only"):
        trainer.fit(BoringModel())

"""Semi-synchronous settings (issue 4): every invalid combination is refused up front, naming the setting and the
fix; valid ones resolve to what torchft's LocalSGD / DiLoCo expect; the default stays ``ddp``."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import example_cli
from torch import nn

from lightning_ft import FTConfigError, FTStrategy
from lightning_ft.algorithms import DEFAULT_OUTER_OPTIMIZER, outer_optimizer_factory, resolve_fragments
from lightning_ft.algorithms.fragments import fragment_modules


@pytest.fixture(autouse=True)
def _single_group(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)


def test_default_is_ddp_with_async_quorum():
    strategy = FTStrategy()
    assert strategy.algorithm.algorithm == "ddp"
    assert not strategy.algorithm.semi_sync
    assert strategy.settings.use_async_quorum is True
    assert FTStrategy(use_async_quorum=False).settings.use_async_quorum is False


def test_semi_sync_defaults_to_synchronous_quorum():
    assert FTStrategy(algorithm="local_sgd", sync_every=4).settings.use_async_quorum is False
    assert FTStrategy(algorithm="local_sgd", sync_every=4, use_async_quorum=True).settings.use_async_quorum is True
    diloco = FTStrategy(algorithm="diloco", sync_every=4)
    assert diloco.settings.use_async_quorum is False
    assert diloco.algorithm.num_fragments == 1 and diloco.algorithm.sync_period == 4


def test_streaming_diloco_settings_resolve():
    algorithm = FTStrategy(
        algorithm="diloco", sync_every=6, fragments=3, fragment_sync_delay=1, fragment_update_alpha=0.5
    ).algorithm
    assert (algorithm.num_fragments, algorithm.sync_period, algorithm.fragment_sync_delay) == (3, 2, 1)
    assert algorithm.fragment_update_alpha == 0.5
    pickle.dumps(algorithm)  # the strategy may be pickled by launchers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "fedavg"}, "algorithm='fedavg'.*ddp, local_sgd, diloco"),
        ({"algorithm": "local_sgd"}, "needs sync_every"),
        ({"algorithm": "diloco"}, "needs sync_every"),
        ({"algorithm": "local_sgd", "sync_every": 0}, "sync_every=0"),
        ({"algorithm": "local_sgd", "sync_every": 2.5}, "sync_every=2.5"),
        ({"sync_every": 4}, "sync_every only applies"),
        ({"algorithm": "local_sgd", "sync_every": 4, "fragments": 2}, "fragments only applies to algorithm='diloco'"),
        ({"outer_optimizer": DEFAULT_OUTER_OPTIMIZER}, "outer_optimizer only applies"),
        (
            {"algorithm": "local_sgd", "sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.1},
            "fragment_sync_delay, fragment_update_alpha only apply",
        ),
        ({"algorithm": "local_sgd", "sync_every": 4, "quantize": True}, "quantize only applies"),
        ({"algorithm": "diloco", "sync_every": 4, "use_async_quorum": True}, "use_async_quorum=True.*diloco"),
        ({"algorithm": "diloco", "sync_every": 6, "fragments": 4}, "sync_every=6 is not divisible.*fragments \\(4\\)"),
        ({"algorithm": "diloco", "sync_every": 2, "fragments": 3}, "sync_every=2 is not divisible"),
        ({"algorithm": "diloco", "sync_every": 4, "fragments": 0}, "fragments=0"),
        ({"algorithm": "diloco", "sync_every": 4, "fragments": "encoder"}, "fragments='encoder'"),
        ({"algorithm": "diloco", "sync_every": 4, "fragments": [["a"], []]}, r"fragments\[1\]"),
        ({"algorithm": "diloco", "sync_every": 4, "fragments": [["a"], ["a"]]}, "'a' is listed twice"),
        ({"algorithm": "diloco", "sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}, "smaller than.*=4"),
        ({"algorithm": "diloco", "sync_every": 8, "fragment_sync_delay": -1}, "fragment_sync_delay=-1"),
        (
            {"algorithm": "diloco", "sync_every": 4, "fragment_update_alpha": 1.5},
            r"fragment_update_alpha=1.5.*\[0, 1\]",
        ),
        ({"algorithm": "diloco", "sync_every": 4, "fragment_update_alpha": -0.1}, "fragment_update_alpha=-0.1"),
        ({"algorithm": "diloco", "sync_every": 4, "outer_optimizer": {"class_path": "SGD"}}, "full import path"),
        (
            {"algorithm": "diloco", "sync_every": 4, "outer_optimizer": {"class_path": "torch.optim.Nope"}},
            "cannot be imported",
        ),
        (
            {"algorithm": "diloco", "sync_every": 4, "outer_optimizer": {"class_path": "torch.nn.Linear"}},
            "not a torch.optim.Optimizer",
        ),
        (
            {
                "algorithm": "diloco",
                "sync_every": 4,
                "outer_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentun": 0.9}},
            },
            "do not fit SGD",
        ),
        (
            {
                "algorithm": "diloco",
                "sync_every": 4,
                "outer_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"params": []}},
            },
            "remove 'params'",
        ),
        ({"algorithm": "diloco", "sync_every": 4, "outer_optimizer": {"init_args": {}}}, "class_path is missing"),
        ({"algorithm": "diloco", "sync_every": 4, "outer_optimizer": 0.7}, "outer_optimizer=0.7"),
    ],
)
def test_invalid_combinations_are_refused(kwargs, match):
    with pytest.raises(FTConfigError, match=match):
        FTStrategy(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_quantize_is_refused_on_cpu():
    with pytest.raises(FTConfigError, match=r"quantize=True needs a CUDA device.*no CUDA device"):
        FTStrategy(algorithm="diloco", sync_every=4, quantize=True)


def test_outer_optimizer_default_and_custom():
    params = [nn.Parameter(torch.zeros(2))]
    default = outer_optimizer_factory(None)(params)
    assert isinstance(default, torch.optim.SGD)
    group = default.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    adam = outer_optimizer_factory({"class_path": "torch.optim.Adam", "init_args": {"lr": 0.1}})(params)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.1
    custom = outer_optimizer_factory(lambda p: torch.optim.SGD(p, lr=0.3))(params)
    assert custom.param_groups[0]["lr"] == 0.3


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.decoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


def test_fragments_by_module_name_cover_every_trainable_parameter():
    fragments = resolve_fragments(_Model(), [["encoder"], ["decoder", "head"]])
    assert fragments == [
        ["encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"],
        ["decoder.weight", "decoder.bias", "head.weight", "head.bias"],
    ]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ([["encoder"], ["decoder", "tail"]], "no module 'tail'.*Top-level modules: decoder, encoder, frozen, head"),
        ([["encoder"], ["decoder"]], "head.weight, head.bias are in no fragment"),
        (
            [["encoder"], ["encoder.0", "decoder", "head"]],
            "'encoder.0.weight' is in module 'encoder.0' and in 'encoder'",
        ),
        ([["encoder", "decoder", "head"], ["frozen"]], r"fragments\[1\]=\['frozen'\]: these modules have no trainable"),
        (5, "only 4 modules with trainable parameters"),
    ],
)
def test_bad_fragments_are_refused_against_the_model(spec, match):
    with pytest.raises(FTConfigError, match=match):
        resolve_fragments(_Model(), spec)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_automatic_split_is_contiguous_disjoint_and_complete(k):
    model = _Model()
    fragments = resolve_fragments(model, k)
    assert len(fragments) == k and all(fragments)
    flat = [name for fragment in fragments for name in fragment]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert flat == trainable  # module order, each parameter exactly once
    holders = fragment_modules(model, fragments)
    shared = {id(p) for holder in holders for p in holder.parameters()}
    assert shared == {id(p) for p in model.parameters() if p.requires_grad}  # shared, not copied


@pytest.mark.parametrize(("config", "algorithm"), [("local_sgd.yaml", "local_sgd"), ("diloco.yaml", "diloco")])
def test_example_configs_parse_into_the_strategy(config, algorithm, monkeypatch):
    """The example YAMLs reach FTStrategy through LightningCLI; jsonargparse turns the outer optimizer's
    class_path/init_args into a callable (the ``Callable[[params], Optimizer]`` hint)."""
    cli = example_cli(monkeypatch, config)
    settings = cli.trainer.strategy.algorithm
    assert settings.algorithm == algorithm and cli.trainer.strategy.settings.use_async_quorum is False
    if algorithm == "diloco":
        assert (settings.num_fragments, settings.sync_period, settings.fragment_sync_delay) == (2, 20, 1)
        outer = settings.outer_optimizer([nn.Parameter(torch.zeros(1))])
        group = outer.param_groups[0]
        assert (type(outer), group["lr"], group["momentum"], group["nesterov"]) == (torch.optim.SGD, 0.7, 0.9, True)

"""Settings: environment fallbacks, and clear errors that name the setting and the fix."""

from __future__ import annotations

import threading

import pytest

from lightning_ft import FTConfigError, FTStrategy


def test_environment_fallbacks(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    settings = FTStrategy().settings
    assert (settings.replica_group_id, settings.num_replica_groups) == (2, 4)
    assert settings.lighthouse == "http://lighthouse:29510"
    assert settings.replica_id == "lightning_ft_00002"


def test_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    settings = FTStrategy(replica_group_id=0, num_replica_groups=1).settings
    assert (settings.replica_group_id, settings.num_replica_groups, settings.lighthouse) == (0, 1, None)


def test_single_group_defaults_need_no_lighthouse(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    assert FTStrategy().settings.needs_embedded_lighthouse


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"min_replica_size": 3, "num_replica_groups": 2, "lighthouse": "http://h:1"}, "min_replica_size"),
        ({"min_replica_size": 0}, "min_replica_size"),
        ({"timeout": 0}, "timeout"),
        ({"quorum_timeout": -5}, "quorum_timeout"),
        ({"connect_timeout": "soon"}, "connect_timeout"),
        ({"process_group": "mpi"}, "process_group"),
        ({"checkpoint_transport": "ftp"}, "checkpoint_transport"),
        ({"replica_group_id": 2, "num_replica_groups": 2, "lighthouse": "http://h:1"}, "replica_group_id"),
        ({"num_replica_groups": 2}, "TORCHFT_LIGHTHOUSE"),
        ({"lighthouse": "lighthouse:29510"}, "lighthouse"),
        ({"max_retries": -1}, "max_retries"),
        ({"find_unused_parameters": "no"}, "find_unused_parameters"),
        ({"ddp_comm_hook": print}, "ddp_comm_hook"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(monkeypatch, kwargs, names):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(FTConfigError, match=names):
        FTStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"replica_groups": 2}, "unknown argument replica_groups (did you mean num_replica_groups"),
        ({"lighthose": "http://h:1"}, "unknown argument lighthose (did you mean lighthouse?)"),
        ({"find_unused_parameter": True}, "(did you mean find_unused_parameters"),
        ({"mp_policy": None}, "mp_policy (FSDP2's name: FTStrategy takes it as fsdp_mixed_precision)"),
    ],
)
def test_a_misspelled_argument_fails_at_construction_naming_the_nearest_valid_names(monkeypatch, kwargs, says):
    """Before this check, ``FTStrategy(replica_groups=2)`` was built, started a lighthouse at setup and failed inside
    torch's DDP constructor. Now construction refuses it, and nothing has started: no thread."""
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    threads = set(threading.enumerate())
    with pytest.raises(FTConfigError) as raised:
        FTStrategy(**kwargs)
    assert says in str(raised.value), str(raised.value)
    assert "docs/configuration.md" in str(raised.value)
    assert set(threading.enumerate()) == threads


def test_what_ddp_strategy_and_torch_ddp_accept_is_still_passed_on(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    strategy = FTStrategy(bucket_cap_mb=10, broadcast_buffers=False, static_graph=False, start_method="popen")
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 10 and strategy._ddp_kwargs["broadcast_buffers"] is False
    assert strategy._start_method == "popen"


def test_the_unused_parameter_search_is_ftstrategys_default_and_an_explicit_choice_wins(monkeypatch):
    """Until setup resolves it for the model (``_choose_unused_search``: no search on one bucket), the default is the
    search; torch's note about it is silenced only where FTStrategy chose it (``_torch_note_pending``, until the first
    forward pass)."""
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    chosen = FTStrategy()
    assert chosen._ddp_kwargs["find_unused_parameters"] is True and chosen._torch_note_pending
    several = FTStrategy(num_replica_groups=2, lighthouse="http://h:1")
    assert several._ddp_kwargs["find_unused_parameters"] is True and several._torch_note_pending
    for value in (True, False):
        made = FTStrategy(find_unused_parameters=value)
        assert made._ddp_kwargs["find_unused_parameters"] is value and not made._torch_note_pending


def test_non_integer_environment_is_refused(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "one")
    with pytest.raises(FTConfigError, match="REPLICA_GROUP_ID"):
        FTStrategy()


def test_the_advertised_address_can_be_chosen_by_network_interface(monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_HOSTNAME", raising=False)
    monkeypatch.delenv("LIGHTNING_FT_INTERFACE", raising=False)
    assert FTStrategy(interface="lo").settings.hostname == "127.0.0.1"
    monkeypatch.setenv("LIGHTNING_FT_INTERFACE", "lo")
    assert FTStrategy().settings.hostname == "127.0.0.1"
    assert FTStrategy(hostname="node-7").settings.hostname == "node-7"  # an argument wins over the environment


def test_an_unknown_interface_or_two_choices_are_refused(monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_HOSTNAME", raising=False)
    monkeypatch.delenv("LIGHTNING_FT_INTERFACE", raising=False)
    with pytest.raises(FTConfigError, match=r"interface='no-such0'.*this machine has: .*lo"):
        FTStrategy(interface="no-such0")
    with pytest.raises(FTConfigError, match="not both"):
        FTStrategy(hostname="node-7", interface="lo")
    monkeypatch.setenv("LIGHTNING_FT_HOSTNAME", "node-7")
    monkeypatch.setenv("LIGHTNING_FT_INTERFACE", "lo")
    with pytest.raises(FTConfigError, match="LIGHTNING_FT_HOSTNAME='node-7' and LIGHTNING_FT_INTERFACE='lo'"):
        FTStrategy()


def test_gradients_are_views_into_ddps_buckets_unless_turned_off():
    """On by default: two copies of the gradient fewer per step. The multi-process tests train with it."""
    assert FTStrategy()._ddp_kwargs["gradient_as_bucket_view"] is True
    assert FTStrategy(gradient_as_bucket_view=False)._ddp_kwargs["gradient_as_bucket_view"] is False
    assert "gradient_as_bucket_view" not in FTStrategy(data_parallel="fsdp")._ddp_kwargs  # no DDP wrapper there


# ---------------------------------------------------------------- resolved once
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, True),
        ({"data_mode": "exactly_once"}, False),
        ({"data_parallel": "fsdp"}, False),
        ({"algorithm": "local_sgd", "sync_every": 4}, False),
        ({"algorithm": "diloco", "sync_every": 4}, False),
        ({"algorithm": "local_sgd", "sync_every": 4, "use_async_quorum": True}, True),
        ({"use_async_quorum": False}, False),
    ],
)
def test_use_async_quorum_defaults_in_one_place_and_an_explicit_value_wins(kwargs, expected):
    """The default comes from ``async_quorum_default`` alone; every mode's resolver sees the same value."""
    from lightning_ft.configuration import async_quorum_default

    strategy = FTStrategy(**kwargs)
    assert strategy.settings.use_async_quorum is expected
    if "use_async_quorum" not in kwargs:
        default = async_quorum_default(
            algorithm=kwargs.get("algorithm", "ddp"),
            data_mode=kwargs.get("data_mode", "sharded"),
            data_parallel=kwargs.get("data_parallel", "ddp"),
        )
        assert default is expected


ENUMERATIONS = {
    "process_group": "PROCESS_GROUPS",
    "checkpoint_transport": "TRANSPORTS",
    "buffer_sync": "BUFFER_SYNC_MODES",
    "world_size_mode": "WORLD_SIZE_MODES",
    "data_mode": "DATA_MODES",
    "algorithm": "ALGORITHMS",
    "data_parallel": "DATA_PARALLEL",
}


def test_every_setting_that_takes_one_of_a_few_strings_is_a_literal_of_what_its_resolver_accepts():
    import typing

    from lightning_ft import settings

    hints = typing.get_type_hints(FTStrategy.__init__)
    for name, choices in ENUMERATIONS.items():
        assert typing.get_origin(hints[name]) is typing.Literal, name
        assert typing.get_args(hints[name]) == getattr(settings, choices), name
        with pytest.raises(FTConfigError, match=name):
            FTStrategy(**{name: "no-such-choice"})


def test_lightning_cli_refuses_a_choice_the_setting_does_not_have():
    """jsonargparse reads the Literal: a wrong choice in YAML fails while parsing, naming the choices."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(FTStrategy, "strategy")
    assert parser.parse_args(["--strategy.algorithm", "diloco"]).strategy.algorithm == "diloco"
    with pytest.raises(Exception, match="local_sgd"):
        parser.parse_args(["--strategy.algorithm", "dilocco"])


def _resolvers():
    """The concept modules' resolvers that lightning_ft.configuration hands the arguments to, by their names."""
    from lightning_ft.algorithms import resolve_algorithm
    from lightning_ft.hsdp.data_parallel import resolve_data_parallel
    from lightning_ft.settings import resolve_settings

    return (resolve_settings, resolve_algorithm, resolve_data_parallel)


# The arguments lightning_ft.configuration reads itself, not through a resolver.
READ_IN_CONFIGURATION = ("data_mode", "gradient_as_bucket_view", "find_unused_parameters")


def unread_arguments(arguments: list[str]) -> list[str]:
    """The FTStrategy arguments that no resolver of lightning_ft.configuration, nor DDPStrategy, reads."""
    import inspect

    from lightning.pytorch.strategies import DDPStrategy

    read = set(READ_IN_CONFIGURATION) | set(inspect.signature(DDPStrategy.__init__).parameters)
    for resolver in _resolvers():
        read |= set(inspect.signature(resolver).parameters)
    return [name for name in arguments if name not in read]


def test_each_argument_is_defined_once_by_the_signature_and_read_by_its_concept():
    """The signature is each argument's one definition: no resolver repeats a default (a resolver parameter with a
    default would be a second one), and every argument reaches a resolver or DDPStrategy (an argument that none
    reads would be accepted and ignored; the check finds a made-up one)."""
    import inspect

    from lightning_ft.strategy_arguments import OWN_ARGUMENTS

    assert unread_arguments(list(OWN_ARGUMENTS)) == []
    assert unread_arguments([*OWN_ARGUMENTS, "made_up_argument"]) == ["made_up_argument"]
    for resolver in _resolvers():
        defaults = [p.name for p in inspect.signature(resolver).parameters.values() if p.default is not p.empty]
        assert defaults == [], (resolver.__name__, defaults)

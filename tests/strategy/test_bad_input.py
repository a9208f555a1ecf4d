"""Bad input fails fast with an error that names the setting and the fix (more cases: test_settings.py,
test_semi_sync_settings.py, test_state.py and test_incompatible_replicas.py for replicas whose models differ,
test_checkpoint_loading.py for corrupt checkpoints, test_data_position.py for corrupt sidecars)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from harness import WORKERS
from helpers import trainer as make_trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from test_cli import clean_env

from lightning_ft import FTStrategy
from lightning_ft.manager.builder import LighthouseUnreachableError

pytestmark = pytest.mark.multiprocess

CLI_DRIVER = WORKERS / "cli_driver.py"

# (init_args line of the YAML, what the error must say, exit code): LightningCLI's parser (jsonargparse) refuses
# wrong types and unknown keys with a usage error (exit 2); FTStrategy's own checks run when the CLI instantiates
# the strategy (an uncaught exception: exit 1).
BAD_YAML = [
    ("min_replica_size: -1", "min_replica_size=-1: must be at least 1", 1),
    ("min_replica_size: 3", "min_replica_size=3 is larger than num_replica_groups=1", 1),
    ("timeout: 0", "timeout=0.0: must be a positive number of seconds", 1),
    ("quorum_timeout: -5", "quorum_timeout=-5.0: must be a positive number of seconds", 1),
    # Settings that take one of a few strings are Literals: LightningCLI refuses another value while parsing.
    (
        "algorithm: bogus",
        'Parser key "algorithm":\n'
        "          Expected a typing.Literal['ddp', 'local_sgd', 'diloco']. Got value: bogus",
        2,
    ),
    (
        "checkpoint_transport: carrier-pigeon",
        'Parser key "checkpoint_transport":\n'
        "          Expected a typing.Literal['http', 'pg']. Got value: carrier-pigeon",
        2,
    ),
    ('timeout: "soon"', "Parser key \"timeout\":\n          Expected a <class 'float'>. Got value: soon", 2),
    ("timout: 30", "Option 'timout' is not accepted", 2),
    ("data_mode: exactly_once\n      use_async_quorum: true", "data_mode='exactly_once' with use_async_quorum=True", 1),
]


def _closed_port() -> int:
    """A loopback port with nothing listening (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_an_unreachable_lighthouse_is_reported_within_connect_timeout(tmp_path, monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    url = f"http://127.0.0.1:{_closed_port()}"
    strategy = FTStrategy(lighthouse=url, connect_timeout=3, quorum_timeout=5, timeout=5)
    trainer = make_trainer(strategy, max_steps=2, default_root_dir=tmp_path)
    with pytest.raises(LighthouseUnreachableError) as raised:
        trainer.fit(BoringModel())
    message = str(raised.value)
    assert f"cannot reach the lighthouse at {url} within connect_timeout=3s" in message, message
    assert "FTStrategy(lighthouse=...)" in message and "TORCHFT_LIGHTHOUSE" in message, message
    assert "lightning-ft lighthouse" in message, message


@pytest.mark.timeout(300)
def test_invalid_yaml_values_stop_the_cli_naming_the_setting(tmp_path):
    """Every bad value in a LightningCLI YAML file stops ``examples/train.py fit`` before training, with a non-zero
    exit code and a message that names the setting. The subprocess timeout is the bound: the CLI must not hang."""
    configs = []
    for index, (line, _, _) in enumerate(BAD_YAML):
        config = tmp_path / f"bad{index}.yaml"
        config.write_text(
            "trainer:\n  max_steps: 1\n  logger: false\n  strategy:\n    class_path: lightning_ft.FTStrategy\n"
            f"    init_args:\n      {line}\n"
        )
        configs.append(str(config))
    result = subprocess.run(
        [sys.executable, str(CLI_DRIVER), *configs],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [outcome["config"] for outcome in outcomes] == configs, result.stdout[-3000:]
    for (line, message, exit_code), outcome in zip(BAD_YAML, outcomes, strict=True):
        assert outcome["exit_code"] == exit_code, f"{line}: exit code {outcome['exit_code']}\n{outcome['stderr']}"
        assert message in outcome["stderr"], f"{line}: the error does not say {message!r}\n{outcome['stderr']}"

"""The `lightning-ft` command and the LightningCLI YAML path, run as real processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import REPO, process_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TRAIN = REPO / "examples" / "train.py"
CONFIG = REPO / "examples" / "configs" / "ft.yaml"


def clean_env(**extra: str) -> dict[str, str]:
    # OMP_NUM_THREADS too: Lightning's DDP setup writes it into this process's environment when an in-process fit
    # ran earlier in the session, and the launcher only sets it where it is unset.
    dropped = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run(args: list[str], timeout: float = 150, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=cwd)


def lightning_ft(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightning_ft_cli", *args]


def test_yaml_class_path_trains_one_group_with_an_embedded_lighthouse(tmp_path):
    """``python train.py`` alone: one group with an embedded lighthouse, and none of torchft's per-step log lines
    (about six a step from its Rust side) nor its CPU-only flight-recorder warning in the output."""
    env = {key: value for key, value in clean_env().items() if key != "RUST_LOG"}
    result = subprocess.run([sys.executable, str(TRAIN), "fit", f"--config={CONFIG}", "--trainer.max_steps=3",
                             "--trainer.enable_progress_bar=false"],
                            capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "max_steps=3` reached" in output
    assert "torchft::" not in output, output[-3000:]
    assert "flight recorder" not in output, output[-3000:]


def test_command_line_class_path_and_init_args_reach_the_strategy():
    result = run([sys.executable, str(TRAIN), "fit", "--trainer.strategy=lightning_ft.FTStrategy",
                  "--trainer.strategy.use_async_quorum=false", "--trainer.strategy.min_replica_size=1",
                  "--print_config"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "class_path: lightning_ft.FTStrategy" in result.stdout
    assert "use_async_quorum: false" in result.stdout


def test_yaml_config_trains_with_exactly_once_data_from_the_command_line(tmp_path):
    """``data_mode`` from the command line on top of the YAML: it trains with ``use_async_quorum`` off. (With the
    default ``use_async_quorum: true`` it is refused: ``test_bad_input.py``'s ``BAD_YAML``.)"""
    exactly_once = ["--trainer.strategy.init_args.data_mode=exactly_once", "--trainer.enable_progress_bar=false"]
    result = run([sys.executable, str(TRAIN), "fit", f"--config={CONFIG}", "--trainer.max_steps=3", *exactly_once,
                  "--trainer.strategy.init_args.use_async_quorum=false"], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=3` reached" in result.stdout + result.stderr


def test_launch_reports_a_group_that_runs_out_of_restarts():
    result = run(lightning_ft("launch", "--replica-groups=1", "--max-restarts=1", "--",
                              "python", "-c", "print('about to fail'); raise SystemExit(3)"))  # fmt: skip
    assert result.returncode == 1
    assert "[group 0] about to fail" in result.stdout
    assert "replica group 0 failed" in result.stderr and "--max-restarts=1" in result.stderr


def test_launch_sets_the_group_environment_and_exits_zero_when_all_groups_finish():
    script = (
        "import os; print('env', os.environ['REPLICA_GROUP_ID'], os.environ['NUM_REPLICA_GROUPS'], "
        "os.environ['TORCHFT_LIGHTHOUSE'].startswith('http://127.0.0.1:'), os.environ['OMP_NUM_THREADS'], "
        "os.environ['TOKIO_WORKER_THREADS'])"
    )
    result = run(lightning_ft("launch", "--replica-groups=2", "--", "python", "-c", script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[group 0] env 0 2 True 1 1" in result.stdout
    assert "[group 1] env 1 2 True 1 1" in result.stdout
    assert re.search(r"^lightning-ft launch: lighthouse status page: http://127\.0\.0\.1:\d+/ ", result.stdout, re.M)


def test_launch_starts_only_the_given_groups_against_an_external_lighthouse():
    script = (
        "import os; print('env', os.environ['REPLICA_GROUP_ID'], os.environ['NUM_REPLICA_GROUPS'], "
        "os.environ['TORCHFT_LIGHTHOUSE'])"
    )
    result = run(lightning_ft("launch", "--replica-groups=4", "--group-ids=3,1", "--lighthouse=http://lh:29510",
                              "--", "python", "-c", script))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[group 3] env 3 4 http://lh:29510" in result.stdout
    assert "[group 1] env 1 4 http://lh:29510" in result.stdout
    assert "[group 0]" not in result.stdout and "[group 2]" not in result.stdout
    assert "starting group(s) 3,1 here" in result.stdout


@pytest.mark.parametrize(
    ("group_ids", "message"),
    [("1,1", "distinct ids in [0, --replica-groups=2)"), ("2", "distinct ids"), ("0,x", "comma-separated")],
)
def test_launch_refuses_bad_group_ids(group_ids, message):
    result = run(lightning_ft("launch", "--replica-groups=2", f"--group-ids={group_ids}", "--", "python", "-c", "1"))
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    "worker_ignores_sigterm",
    [False, pytest.param(True, marks=pytest.mark.paths)],  # the escalation to SIGKILL: in `make test-extra`
    ids=["worker-stops", "worker-ignores-sigterm"],
)
def test_launch_stops_everything_it_started_on_sigterm(tmp_path, worker_ignores_sigterm):
    """With a worker that ignores SIGTERM (as one stuck in a collective does), torchrun's agent outlasts the
    launcher's grace; the launcher then kills the agent's session and the worker's, which is a session of its own."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if worker_ignores_sigterm else ""
    script = (
        f"import os, signal, time; {ignore}"
        f"open(f'{tmp_path}/pid.' + os.environ['REPLICA_GROUP_ID'], 'w').write(str(os.getpid())); time.sleep(600)"
    )
    launcher = subprocess.Popen(lightning_ft("launch", "--replica-groups=2", "--", "python", "-c", script),
                                env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine takes long to start two torchrun jobs
        while not all((tmp_path / f"pid.{g}").exists() and (tmp_path / f"pid.{g}").read_text() for g in (0, 1)):
            assert time.monotonic() < deadline, "workers did not start"
            assert launcher.poll() is None, launcher.stdout.read().decode()
            time.sleep(0.05)
        workers = [int((tmp_path / f"pid.{g}").read_text()) for g in (0, 1)]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 130
        deadline = time.monotonic() + 30
        while not all(process_gone(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} still running after the launcher stopped"
            time.sleep(0.05)
    finally:
        # The groups run in sessions of their own: only the launcher's SIGTERM handling reaches them.
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        # Whatever the outcome, no worker of this test outlives it: by the PIDs they wrote, checked to be ours.
        for pid_file in tmp_path.glob("pid.*"):
            pid = int(pid_file.read_text() or 0)
            try:
                ours = pid > 0 and str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            except OSError:  # gone already
                continue
            if ours and not process_gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("command", [["lighthouse", "--bind"], ["launch", "--replica-groups=1", "--lighthouse-bind"]])
def test_a_lighthouse_port_in_use_is_refused_naming_the_port_and_the_fix(command):
    """Another program listens on the port the lighthouse is told to bind: exit 2 at once with a message naming the
    address, the flag and port 0, no traceback (torchft alone says "Address already in use (os error 98)")."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        done = run(lightning_ft(*command, address, *(["--", "true"] if command[0] == "launch" else [])), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot start a lighthouse on {address}: the port is already in use" in done.stderr, done.stderr
    assert "HOST:0" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_lighthouse_command_serves_until_sigterm():
    process = subprocess.Popen(lightning_ft("lighthouse", "--bind=127.0.0.1:0"), env=clean_env(), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=5):
            pass
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_command_line_tool_imports_neither_lightning_nor_torch_and_its_lighthouse_forms_quorums():
    """The launcher's start-up is on every job's critical path (benchmarks/HISTORY.md §4): importing the command's
    modules and starting a lighthouse must not import Lightning or torch. A torchft importing later in the same
    process must still find the lighthouse's native module, and a real Manager client must get a quorum from it."""
    script = (
        "import sys\n"
        "import lightning_ft_cli.main, lightning_ft_cli.launch, lightning_ft_cli.lighthouse, lightning_ft_cli.report\n"
        "from lightning_ft_job.lighthouse_server import start_lighthouse\n"
        "lighthouse = start_lighthouse(min_replicas=1)\n"
        "heavy = sorted(name for name in ('torch', 'torchft', 'lightning', 'lightning_ft') if name in sys.modules)\n"
        "print('HEAVY', heavy, flush=True)\n"
        "from datetime import timedelta\n"
        "from torchft.coordination import LighthouseClient, LighthouseServer\n"
        "assert type(lighthouse.server) is LighthouseServer\n"
        "client = LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=10))\n"
        "quorum = client.quorum(replica_id='only', timeout=timedelta(seconds=10))\n"
        "print('QUORUM', quorum.quorum_id, [m.replica_id for m in quorum.participants], flush=True)\n"
        "lighthouse.shutdown()\n"
    )
    result = run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout, result.stdout
    assert "QUORUM 1 ['only']" in result.stdout, result.stdout


def test_version_names_the_installed_distribution():
    """``lightning-ft --version``: the version ``pyproject.toml`` gives, from the installed distribution's metadata."""
    from importlib import metadata

    result = run(lightning_ft("--version"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"lightning-ft {metadata.version('lightning-ft')}"
    assert metadata.version("lightning-ft") == "0.1.0.dev0"


QUORUM_CLIENT = (
    "import os, sys; from datetime import timedelta\n"
    "from lightning_ft_job.lighthouse_server import lighthouse_server_class\n"
    "lighthouse_server_class()  # loads torchft's native module without torch\n"
    "from torchft._torchft import LighthouseClient\n"
    "client = LighthouseClient(os.environ['TORCHFT_LIGHTHOUSE'], connect_timeout=timedelta(seconds=10))\n"
    "for _ in range(3):\n"
    "    client.quorum(replica_id='only', timeout=timedelta(seconds=10))\n"
    "print('QUORUMS DONE', flush=True)\n"
    "print('QUIET', os.environ.get('TORCH_CPP_LOG_LEVEL'), os.environ.get('PYTHONWARNINGS'), flush=True)\n"
)


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_the_launcher_prints_no_per_quorum_lines_unless_verbose(verbose):
    """Three quorums through the embedded lighthouse: by default none of torchft's per-quorum INFO lines reach the
    terminal; ``--verbose`` shows them (so the default's silence is not an accident of where they are printed)."""
    env = {key: value for key, value in clean_env().items() if key != "RUST_LOG"}
    flags = ["--verbose"] if verbose else []
    result = subprocess.run(
        lightning_ft("launch", "--replica-groups=1", *flags, "--", "python", "-c", QUORUM_CLIENT),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "[group 0] QUORUMS DONE" in output
    assert ("Quorum!" in output) == verbose, output[-3000:]
    # Torch's C++ warnings and Lightning's pytree FutureWarning, printed once by every worker, are off by default.
    quiet = "[group 0] QUIET ERROR ignore::FutureWarning:lightning.pytorch.utilities._pytree" in output
    assert quiet != verbose, output[-3000:]

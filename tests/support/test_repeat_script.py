"""``tests/repeat.py``: each run of the suite leaves a record with every failure, and its busy loops end with it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tests"))
repeat = importlib.import_module("repeat")

pytestmark = pytest.mark.timeout(120)


def test_a_run_records_each_failed_test_with_its_failure_and_ends_its_busy_loops(tmp_path, monkeypatch):
    suite = tmp_path / "test_sample.py"
    suite.write_text(
        "import time\n\ndef test_passes():\n    time.sleep(1.0)\n\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
    )
    record = tmp_path / "runs.jsonl"
    loops: list = []
    start = repeat.start_busy_loops
    monkeypatch.setattr(repeat, "start_busy_loops", lambda count: loops.extend(start(count)) or loops)
    command = f"{sys.executable} -m pytest -q -p no:cacheprovider {suite}"
    code = repeat.main(["--runs", "2", "--busy", "1", "--command", command, "--record", str(record)])
    assert code == 1
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [run["run"] for run in runs] == [1, 2] and all(run["busy_loops"] == 1 for run in runs)
    for run in runs:
        assert run["tests"] == 2 and run["exit_code"] != 0
        [failure] = run["failed"]
        assert failure["test"].endswith("test_fails") and "one is not two" in failure["failure"]
        timed = {entry["test"].rsplit("::", 1)[1]: entry["seconds"] for entry in run["slowest"]}
        assert timed["test_passes"] >= 1.0 and set(timed) == {"test_passes", "test_fails"}, run["slowest"]
    assert len(loops) == 2 and all(loop.poll() is not None for loop in loops), "a busy loop outlived its run"
    assert "2 runs (2 under load), 2 failed" in repeat.summary(repeat.read_record(record))


def test_a_run_that_wrote_no_report_is_a_failure():
    ran, failed = repeat.failures(REPO / "no-such-report.xml")
    assert ran == 0 and failed and "no JUnit report" in failed[0]["failure"]


def test_the_commit_is_marked_changed_by_any_change_but_the_record_itself(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    record, code = tmp_path / "runs.jsonl", tmp_path / "code.py"
    record.write_text("")
    code.write_text("")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    record.write_text('{"run": 1}\n')  # an earlier run of the same campaign
    assert not repeat.commit(record, repo=tmp_path).endswith("+changes")
    code.write_text("changed = True\n")
    assert repeat.commit(record, repo=tmp_path).endswith("+changes")

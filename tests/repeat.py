"""Run the test suite N times, optionally beside K busy loops, and keep a record of every run in the repository.

A test that fails once in twenty runs is a bug (in the code or in the test); this is how it is found before CI finds
it. Each run is ``make test`` (or ``--command``) with pytest's JUnit report; after each, every failed test is printed
with its failure, and one line is appended to ``tests/records/suite_runs.jsonl``: when, at which commit, on which
machine, how loaded, how long, how many passed, and each failure. Records add up across sessions, so the flake
budget is counted over all of them.

The busy loops are this script's own processes (``python -c 'while True: pass'``), started before each run and
ended by PID after it: with 2 of them on a 2-core machine, the suite's processes get about half the CPU they would.
Usage::

    python tests/repeat.py --runs 3 --busy 2        # or: make test-repeat ARGS="--runs 3 --busy 2"
    python tests/repeat.py --runs 1 --command '.venv/bin/python -m pytest -m "not multiprocess" tests'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "records" / "suite_runs.jsonl"
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside each run (2 fill a 2-core machine)")
    parser.add_argument("--command", default="make test", help="what one run is (default: make test)")
    parser.add_argument("--record", type=Path, default=RECORD, help="the JSON-lines record to append to")
    parser.add_argument("--note", default="", help="a word on the run, kept in its record")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be at least 1 and --busy at least 0")
    return args


def slowest(junit: Path, count: int = 15) -> list[dict[str, Any]]:
    """The ``count`` slowest tests of a JUnit XML report, slowest first: which tests hold ``make test``'s time."""
    if not junit.exists():
        return []
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    timed = [(float(case.get("time") or 0.0), f"{case.get('classname', '')}::{case.get('name', '')}") for case in cases]
    return [{"test": name, "seconds": round(seconds, 1)} for seconds, name in sorted(timed, reverse=True)[:count]]


def failures(junit: Path) -> tuple[int, list[dict[str, str]]]:
    """(tests run, each failed or errored test with the start of its failure) from a JUnit XML report."""
    if not junit.exists():
        return 0, [{"test": "(no report)", "failure": "pytest wrote no JUnit report: it did not run to the end"}]
    root = ElementTree.parse(junit).getroot()
    ran, failed = 0, []
    for case in root.iter("testcase"):
        ran += 1
        for problem in [*case.findall("failure"), *case.findall("error")]:
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            text = (problem.get("message") or "") + "\n" + (problem.text or "")
            failed.append({"test": name, "failure": text.strip()[:2000]})
    return ran, failed


def commit(record: Path, repo: Path = REPO) -> str:
    """The commit the suite ran at, with ``+changes`` when the work tree differs from it: in anything but the record
    itself, which the earlier runs of a ``--runs N`` campaign have appended to."""
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    status = ["git", "status", "--porcelain", "--", "."]
    if record.resolve().is_relative_to(repo.resolve()):  # a record outside the repository changes nothing in it
        status.append(f":(exclude){record.resolve()}")
    dirty = subprocess.run(status, cwd=repo, capture_output=True, text=True).stdout.strip()
    return result.stdout.strip() + ("+changes" if dirty else "")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def start_busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(BUSY_LOOP, start_new_session=True) for _ in range(count)]


def stop_busy_loops(loops: list[subprocess.Popen[bytes]]) -> None:
    for loop in loops:
        if loop.poll() is None:
            os.kill(loop.pid, signal.SIGKILL)
        loop.wait()


def run_once(args: argparse.Namespace, index: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lightning-ft-repeat-") as scratch:
        junit = Path(scratch) / "junit.xml"
        env = {**os.environ, "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} --junitxml={junit}".strip()}
        loops = start_busy_loops(args.busy)
        started = time.monotonic()
        try:
            code = subprocess.run(shlex.split(args.command), cwd=REPO, env=env, check=False).returncode
        finally:
            stop_busy_loops(loops)
        seconds = time.monotonic() - started
        ran, failed = failures(junit)
        slow = slowest(junit)
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(args.record),
        "command": args.command,
        "run": index + 1,
        "of": args.runs,
        "busy_loops": args.busy,
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "wall_seconds": round(seconds, 1),
        "exit_code": code,
        "tests": ran,
        "failed": failed,
        "slowest": slow,
        "note": args.note,
    }


def summary(records: list[dict[str, Any]]) -> str:
    """Every record's outcome, then the totals: runs, runs under load, failed runs, and each test that failed."""
    lines = []
    for record in records:
        outcome = "passed" if record["exit_code"] == 0 and not record["failed"] else "FAILED"
        lines.append(
            f"{record['time']} {record['commit']}: {outcome}, {record['tests']} tests, {record['wall_seconds']:.0f} s, "
            f"{record['busy_loops']} busy loops"
        )
        for failure in record["failed"]:
            lines.append(f"    {failure['test']}: {failure['failure'].splitlines()[0] if failure['failure'] else ''}")
    loaded = [r for r in records if r["busy_loops"] > 0]
    failed = [r for r in records if r["exit_code"] != 0 or r["failed"]]
    lines.append(f"{len(records)} runs ({len(loaded)} under load), {len(failed)} failed")
    return "\n".join(lines)


def read_record(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.record.parent.mkdir(parents=True, exist_ok=True)
    exit_code = 0
    for index in range(args.runs):
        record = run_once(args, index)
        with args.record.open("a") as file:
            file.write(json.dumps(record) + "\n")
        print(summary([record]), flush=True)
        exit_code = exit_code or (1 if record["exit_code"] or record["failed"] else 0)
    print("\nEvery run on record:\n" + summary(read_record(args.record)))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())

"""Run the fault test matrix and render its measured figures as the table in docs/reliability.md.

Every fault test records, once its assertions have passed, what the failure cost (see ``tests/support/matrix.py``).
This runs those tests with ``LIGHTNING_FT_MATRIX_OUT`` set, then writes the rows, with the machine, to a new
``benchmarks/results/fault_matrix/<UTC>_<commit>.json`` and their markdown table to
``benchmarks/results/fault_matrix/latest.md``. Usage::

    python -m benchmarks.fault_matrix.fault_matrix                # the CI matrix (about 10 minutes on 2 cores)
    python -m benchmarks.fault_matrix.fault_matrix --soak         # plus the 20-kill soak run (about 5 more)
    python -m benchmarks.fault_matrix.fault_matrix --report-only  # latest.md from the newest results file
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common.results import RESULTS, header, new_results_file, newest
from benchmarks.common.run_util import REPO

SECTION = "fault_matrix"
MATRIX_TESTS = [
    "tests/strategy/test_fault_tolerance.py",
    "tests/callbacks/test_failure_injection.py",
    "tests/algorithms/test_semi_sync_recovery.py::test_semi_sync_sigkill_during_a_sync",
    "tests/data/test_data_position_recovery.py::test_every_group_resumes_its_own_shard_from_the_last_checkpoint",
    "tests/cli/test_chaos.py",
    "tests/manager/test_lighthouse_restart.py",
    "tests/strategy/test_network_partition.py::test_a_partitioned_group_drops_out_and_rejoins_after_the_partition_heals",
]


def run_matrix(soak: bool, out: Path) -> int:
    tests = [t for t in MATRIX_TESTS if (REPO / t.split("::")[0]).exists()]
    marker = "multiprocess" if soak else "multiprocess and not soak"
    env = {**os.environ, "LIGHTNING_FT_MATRIX_OUT": str(out)}
    command = [sys.executable, "-m", "pytest", "-q", "-m", marker, *tests]
    print("running:", " ".join(command), flush=True)
    return subprocess.run(command, cwd=REPO, env=env).returncode


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def render(rows: list[dict]) -> str:
    lines = [
        "| case | steps lost by survivors | survivors commit again after | failed group commits again after "
        "| failed group: restart to healed | replicas |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "kills" in row:
            lost = f"{row['uncommitted_steps_all_groups']} in all groups for {row['kills']} kills"
            lines.append(f"| {row['case']} | {lost} | – | – | – | bit-identical |")
            continue
        if "first_commit_after_relaunch_s" in row:
            lines.append(
                f"| {row['case']} | {row['steps_lost']} (since the checkpoint) | – "
                f"| {_seconds(row['first_commit_after_relaunch_s'])} (relaunch included) | – | bit-identical |"
            )
            continue
        if "stall_s" in row:
            lines.append(
                f"| {row['case']} | {row['steps_lost']} | {_seconds(row['stall_s'])} (stalled: no quorum without a "
                f"lighthouse; {_seconds(row['resumed_after_new_lighthouse_listens_s'])} after the new one listens) "
                f"| – (nobody failed) | – (no restart, no heal) | bit-identical |"
            )
            continue
        if "victim_committed_after_partition_heals_s" in row:
            lines.append(
                f"| {row['case']} | {row['steps_lost']} | {_seconds(row['survivors_resumed_s'])} "
                f"| {_seconds(row['victim_committed_after_partition_heals_s'])} after the partition heals "
                f"| no restart: healed in the same process | bit-identical |"
            )
            continue
        unit = row.get("unit", "steps")
        lost = f"{row['steps_lost']}" + ("" if unit == "steps" else f" {unit}")
        restart = _seconds(row.get("victim_restart_to_heal_s"))
        if row.get("healed_in_same_process"):
            restart = "no restart: healed in the same process"
        lines.append(
            f"| {row['case']} | {lost} | {_seconds(row['survivors_resumed_s'])} "
            f"| {_seconds(row['victim_committed_s'])} | {restart} | bit-identical |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", action="store_true", help="include the soak-marked runs")
    parser.add_argument("--report-only", action="store_true", help="latest.md from the newest results file only")
    parser.add_argument("--label", help="appended to the results file's name: <UTC>_<commit>_<label>.json")
    args = parser.parse_args()
    latest = RESULTS / SECTION / "latest.md"
    if args.report_only:
        path = newest(SECTION)
        if path is None:
            parser.error(f"no results file under {RESULTS / SECTION}")
        latest.write_text(render(json.loads(path.read_text())["rows"]))
        print(latest.read_text())
        return 0
    results = new_results_file(SECTION, label=args.label)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.jsonl"
        code = run_matrix(args.soak, out)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    results.write_text(json.dumps({**header(), "soak": args.soak, "pytest_exit": code, "rows": rows}, indent=1))
    table = render(rows)
    latest.write_text(table)
    print(table)
    print(f"wrote {results} and {latest}")
    if code != 0:
        print(f"pytest exited {code}: rows above are from the tests that passed", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

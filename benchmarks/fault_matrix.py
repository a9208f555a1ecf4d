"""Run the fault test matrix and render its measured figures as the table in docs/reliability.md.

Every fault test records, once its assertions have passed, what the failure cost (see ``tests/processes/matrix.py``).
This runs those tests with ``LIGHTNING_FT_MATRIX_OUT`` set, then writes ``benchmarks/results/fault_matrix.jsonl`` and a
markdown table ``benchmarks/results/fault_matrix.md``. Usage::

    python benchmarks/fault_matrix.py            # the CI matrix (about 10 minutes on 2 cores)
    python benchmarks/fault_matrix.py --soak     # plus the 20-kill soak run (about 5 more)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MATRIX_TESTS = [
    "tests/processes/test_fault_tolerance.py",
    "tests/processes/test_failure_injection.py",
    "tests/processes/test_semi_sync_recovery.py::test_semi_sync_sigkill_during_a_sync",
    "tests/processes/test_data_position_recovery.py::test_every_group_resumes_its_own_shard_from_the_last_checkpoint",
    "tests/processes/test_chaos.py",
    "tests/processes/test_lighthouse_restart.py",
    "tests/processes/test_network_partition.py::test_a_partitioned_group_drops_out_and_rejoins_after_the_partition_heals",
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
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.jsonl"
        code = run_matrix(args.soak, out)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    (RESULTS / "fault_matrix.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = render(rows)
    (RESULTS / "fault_matrix.md").write_text(table)
    print(table)
    if code != 0:
        print(f"pytest exited {code}: rows above are from the tests that passed", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

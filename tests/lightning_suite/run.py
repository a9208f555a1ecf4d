"""Lightning's own tests as acceptance: run them once as they are and once under FTStrategy, and record what differs.

    python tests/lightning_suite/run.py --lightning-tests <Lightning checkout at the installed version's tag>/tests

(``make lightning-suite LIGHTNING_TESTS=...``; the sources are brought in by hand: CI has no network.) Both runs use
this environment's Lightning; the second loads :mod:`ft_plugin`, which gives every single-device Trainer
``FTStrategy()``. A test that passes as it is and not under FTStrategy is a difference: it either has a reason in
:data:`KNOWN_DIFFERENCES` (a documented, deliberate one) or it is a lightning-ft bug. Each run is kept in
``tests/records/lightning_suite/<UTC>_<commit>.json``: counts per file, and every difference with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from fnmatch import fnmatchcase
from pathlib import Path

from ft_plugin import ENV_STRATEGY

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RECORDS = REPO / "tests" / "records" / "lightning_suite"

# The folders of Lightning's tests the acceptance covers (relative to its tests/ directory).
DEFAULT_PATHS = (
    "tests_pytorch/callbacks",
    "tests_pytorch/checkpointing",
    "tests_pytorch/loops",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/core/test_lightning_optimizer.py",
)
# Needs files that are not in the sources (Lightning's legacy checkpoints, downloaded by its CI).
IGNORED = ("tests_pytorch/checkpointing/test_legacy_checkpoints.py",)

# Every deliberate difference, at most five; docs/lightning-compatibility.md says why each one is so.
REASONS: dict[str, str] = {
    "data_parallel": (
        "FTStrategy is data parallel, as Lightning's DDPStrategy: the test fails the same way under DDPStrategy with "
        "one process (a DistributedSampler in every loader, no inference_mode with Gloo, no batch-size tuner, the "
        "single-device strategy's attributes). Found by the control run, not listed by hand."
    ),
    "ft_callbacks": (
        "FTStrategy adds its own callbacks: they are in trainer.callbacks, the fault-tolerance monitor logs ft/* "
        "metrics beside the user's, and a resumed loader without state of its own is put back at its position by "
        "counting batches (Lightning starts its epoch over)."
    ),
    "closure_before_vote": (
        "The step's closure runs before the commit vote, whose gradient every group averages: an optimizer whose "
        "line search evaluates it a loss-dependent number of times (LBFGS) is refused, and an optimizer that ignores "
        "the closure it is given is not caught as Lightning catches it (the closure has run already)."
    ),
    "manual_optimization_steps": (
        "With manual optimization, one vote per batch: global_step counts committed batches, not optimizer.step() "
        "calls, so with several optimizers per batch max_steps, logging and LR-monitor intervals count batches."
    ),
    "crash_safe_checkpoints": (
        "Checkpoints are written crash-safely by lightning-ft's AtomicCheckpointIO (temporary file, fsync, rename), "
        "not by TorchCheckpointIO, which the test patches."
    ),
}
# fnmatch patterns of test ids (file::name, parameters included) -> a key of REASONS.
KNOWN_DIFFERENCES: dict[str, str] = {
    "*/test_throughput_monitor.py::*": "ft_callbacks",
    "*/test_device_stats_monitor.py::test_device_stats_cpu*": "ft_callbacks",
    "*/test_callbacks.py::test_configure_callbacks_hook_multiple_calls": "ft_callbacks",
    "*/test_loops.py::test_fit_loop_save_and_restore_dataloaders[[]<lambda>-False-batches_before2-*": "ft_callbacks",
    "*::*lbfgs*": "closure_before_vote",
    "*/test_backward_calls.py::test_backward_count_with_closure": "closure_before_vote",
    "*/test_closure.py::test_optimizer_step_no_closure_raises": "closure_before_vote",
    "*/test_manual_optimization.py::test_multiple_optimizers_manual_call_counts*": "manual_optimization_steps",
    "*/test_manual_optimization.py::test_step_with_optimizer_closure_with_different_frequencies": (
        "manual_optimization_steps"
    ),
    "*/test_lr_monitor.py::test_lr_monitor_*multi_lrs[[]step[]]": "manual_optimization_steps",
    "*/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options": "crash_safe_checkpoints",
}


def test_id(tests_dir: Path, classname: str, name: str) -> str:
    """pytest's node id from JUnit's ``classname`` (the module's dotted path, then any test class) and ``name``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        file = "/".join(parts[:end]) + ".py"
        if (tests_dir / file).is_file():
            return "::".join([file, *parts[end:], name])
    return f"{classname}::{name}"


def outcomes(junit_xml: Path, tests_dir: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome (passed, failed, skipped) and first message line, from pytest's JUnit XML. A test that
    passed its call but failed at setup or teardown counts as failed."""
    results: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        test = test_id(tests_dir, case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                lines = (child.get("message") or child.tag).splitlines() or [child.tag]
                outcome, message = "failed", lines[0][:300]
                break
            if child.tag == "skipped":
                outcome = "skipped"
        if test not in results or outcome == "failed":
            results[test] = (outcome, message)
    return results


def run_pytest(tests_dir: Path, paths: list[str], junit: Path, strategy: str | None, extra: list[str]) -> float:
    """One pytest run of ``paths``: as they are (``strategy=None``), or with single-device Trainers given ``"ft"``
    (FTStrategy) or ``"ddp"`` (Lightning's DDPStrategy, the control)."""
    env = dict(os.environ)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300", f"--junitxml={junit}"]
    command += [f"--ignore={path}" for path in IGNORED]
    if strategy is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        env[ENV_STRATEGY] = strategy
        command += ["-p", "ft_plugin"]
    started = time.monotonic()
    subprocess.run([*command, *extra, *paths], cwd=tests_dir, env=env, check=False)
    return time.monotonic() - started


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def reason_for(test: str, under_ddp: dict[str, tuple[str, str]]) -> str | None:
    """The difference's reason: data parallelism's when the control run fails it too, else the listed one."""
    if under_ddp.get(test, ("passed", ""))[0] != "passed":
        return "data_parallel"
    for pattern, reason in KNOWN_DIFFERENCES.items():
        if fnmatchcase(test, pattern):
            return reason
    return None


def build_record(
    baseline: dict[str, tuple[str, str]],
    under_ft: dict[str, tuple[str, str]],
    under_ddp: dict[str, tuple[str, str]],
    meta: dict[str, object],
) -> dict[str, object]:
    per_file: dict[str, Counter[str]] = {}
    differences = []
    for test, (outcome, _) in sorted(baseline.items()):
        file = test.split("::", 1)[0]
        counts = per_file.setdefault(file, Counter())
        if outcome != "passed":
            counts["not_passing_as_they_are"] += 1
            continue
        counts["passed_as_they_are"] += 1
        ft_outcome, message = under_ft.get(test, ("missing", "not run under FTStrategy"))
        if ft_outcome == "passed":
            counts["passed_under_ft"] += 1
            continue
        counts["differ"] += 1
        reason = reason_for(test, under_ddp)
        differences.append({"test": test, "outcome": ft_outcome, "message": message, "reason": reason})
    unexplained = [d for d in differences if d["reason"] is None]
    totals = Counter()
    for counts in per_file.values():
        totals.update(counts)
    return {
        **meta,
        "totals": dict(totals),
        "per_file": {file: dict(counts) for file, counts in sorted(per_file.items())},
        "reasons": {key: text for key, text in REASONS.items() if any(d["reason"] == key for d in differences)},
        "differences": differences,
        "unexplained": len(unexplained),
        "verdict": "pass" if not unexplained and len(REASONS) <= 5 else "fail",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lightning-tests", type=Path, required=True, help="Lightning's tests/ directory")
    parser.add_argument("--source-tag", default="", help="the tag the sources were taken at (for the record)")
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lightning-suite"))
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    import lightning

    args.work_dir.mkdir(parents=True, exist_ok=True)
    baseline_xml, ft_xml = args.work_dir / "as_they_are.xml", args.work_dir / "under_ft.xml"
    ddp_xml = args.work_dir / "under_ddp.xml"
    seconds = {
        "as_they_are": run_pytest(args.lightning_tests, args.paths, baseline_xml, None, args.pytest_args),
        "under_ft": run_pytest(args.lightning_tests, args.paths, ft_xml, "ft", args.pytest_args),
    }
    baseline, under_ft = outcomes(baseline_xml, args.lightning_tests), outcomes(ft_xml, args.lightning_tests)
    # The control: the tests that differ, under Lightning's own DDPStrategy with one process.
    differing = [test for test, (outcome, _) in baseline.items() if outcome == "passed" and test in under_ft]
    differing = [test for test in differing if under_ft[test][0] != "passed"]
    under_ddp: dict[str, tuple[str, str]] = {}
    if differing:
        seconds["control_under_ddp"] = run_pytest(args.lightning_tests, differing, ddp_xml, "ddp", args.pytest_args)
        under_ddp = outcomes(ddp_xml, args.lightning_tests)
    meta = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "lightning_installed": lightning.__version__,
        "lightning_sources": args.source_tag,
        "paths": args.paths,
        "seconds": {name: round(value) for name, value in seconds.items()},
    }
    record = build_record(baseline, under_ft, under_ddp, meta)
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{meta['commit']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    totals = record["totals"]
    print(
        f"lightning-suite: {totals.get('passed_as_they_are', 0)} pass as they are, "
        f"{totals.get('passed_under_ft', 0)} of them under FTStrategy; {len(record['differences'])} differ "
        f"({record['unexplained']} without a reason); record: {path.relative_to(REPO)}"
    )
    for difference in record["differences"]:
        print(f"  {difference['test']}: {difference['reason'] or 'NO REASON'}: {difference['message']}")
    return 0 if record["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

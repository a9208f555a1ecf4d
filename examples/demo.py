"""`make demo`: two replica groups train; one is SIGKILLed mid-run, restarts, heals from its peer, and both finish
with bit-identical weights and optimizer state.

It drives the real thing: ``lightning-ft launch`` (an embedded lighthouse plus one torchrun job per group) running
``examples/train.py`` with ``examples/configs/demo.yaml``. It follows the job through the event log that
``--events-dir`` turns on, and kills the victim by PID. The full output of the job goes to ``<run>/launch.log``.

While group 1 restarts, the demo holds group 0 between two steps (``examples/demo_hold.py``), so that on a busy
machine group 0 cannot finish its remaining steps before group 1 is back to heal from it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_ft_job.events import read_events

HERE = Path(__file__).resolve().parent


def events(directory: Path, event: str, **match: Any) -> list[dict[str, Any]]:
    if not directory.exists():
        return []
    return [
        record
        for record in read_events(directory)
        if record["event"] == event and all(record.get(key) == value for key, value in match.items())
    ]


def wait_for(what: str, condition: Any, job: subprocess.Popen[bytes], timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if job.poll() is not None:
            raise SystemExit(f"demo: the job ended (exit {job.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--kill-at-step", type=int, default=300)
    parser.add_argument(
        "train_args",
        nargs="*",
        help="after `--`: more arguments for examples/train.py (LightningCLI), e.g. --trainer.accelerator=gpu",
    )
    args = parser.parse_args()

    run = Path(args.run_dir).resolve()
    if (run / "events").exists():
        for stale in (run / "events").glob("*.jsonl"):
            stale.unlink()
    run.mkdir(parents=True, exist_ok=True)
    (run / "hold.group0").unlink(missing_ok=True)
    event_dir = run / "events"
    command = [
        sys.executable, "-m", "lightning_ft_cli", "launch",
        "--replica-groups=2", "--max-restarts=2", f"--events-dir={event_dir}",
        "--", "python", str(HERE / "train.py"), "fit", f"--config={HERE / 'configs' / 'demo.yaml'}", *args.train_args,
    ]  # fmt: skip
    print(f"demo: starting 2 replica groups; full output in {run / 'launch.log'}", flush=True)
    with open(run / "launch.log", "wb") as log:
        # The job runs in the run directory, so what Lightning writes (its config, logs) stays there.
        job = subprocess.Popen(command, cwd=run, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return follow(job, run, event_dir, args.kill_at_step)
        finally:
            (run / "hold.group0").unlink(missing_ok=True)
            if job.poll() is None:
                job.send_signal(signal.SIGTERM)
                try:
                    job.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(job.pid, signal.SIGKILL)


def follow(job: subprocess.Popen[bytes], run: Path, event_dir: Path, kill_at_step: int) -> int:
    started = wait_for("group 1 to start", lambda: events(event_dir, "started", group=1), job)[-1]
    victim, attempt = started["pid"], started["attempt"]
    wait_for(
        f"group 1 to reach step {kill_at_step}",
        lambda: any(r["step"] >= kill_at_step for r in events(event_dir, "step", group=1, pid=victim, committed=True)),
        job,
    )
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    print(f"demo: group 1 reached step {kill_at_step}: SIGKILL to its worker (pid {victim})", flush=True)

    def solo_steps() -> list[dict[str, Any]]:
        records = events(event_dir, "step", group=0, committed=True)
        return [r for r in records if r["time"] > killed_at and r["participants"] == 1]

    alone = wait_for("group 0 to commit on its own", lambda: len(solo_steps()) >= 5 and solo_steps(), job)
    print(
        f"demo: group 0 keeps training on its own: step {alone[0]['step']} committed "
        f"{alone[0]['time'] - killed_at:.2f}s after the kill, with 1 participant",
        flush=True,
    )
    hold = run / "hold.group0"
    hold.touch()
    print("demo: holding group 0 at its next step until group 1 is back, however long its restart takes", flush=True)

    restarted = wait_for(
        "torchrun to restart group 1", lambda: events(event_dir, "started", group=1, attempt=attempt + 1), job
    )
    hold.unlink()
    restarted_pid = restarted[-1]["pid"]
    print(
        f"demo: torchrun restarted group 1 (pid {restarted_pid}, its Manager up "
        f"{restarted[-1]['time'] - killed_at:.1f}s after the kill)",
        flush=True,
    )
    healed = wait_for("group 1 to heal", lambda: events(event_dir, "healed", group=1, pid=restarted_pid), job)
    print(
        f"demo: group 1 healed from group 0's live state at committed step {healed[0]['step']} "
        f"({healed[0]['time'] - killed_at:.1f}s after the kill, no checkpoint read)",
        flush=True,
    )
    rejoined = wait_for(
        "both groups to commit together again",
        lambda: [
            r
            for r in events(event_dir, "step", group=0, committed=True)
            if r["participants"] == 2 and r["time"] > healed[0]["time"]
        ],
        job,
    )
    print(f"demo: both groups commit together again from step {rejoined[0]['step']}", flush=True)

    code = job.wait(timeout=600)
    finished = sorted(events(event_dir, "finished"), key=lambda r: r["group"])
    for record in finished:
        print(
            f"demo: group {record['group']} finished at global_step {record['global_step']}, "
            f"state fingerprint {record['fingerprint'][:16]}",
            flush=True,
        )
    identical = len(finished) == 2 and len({r["fingerprint"] for r in finished}) == 1
    print(f"demo: replicas bit-identical (model + optimizer state): {'yes' if identical else 'NO'}", flush=True)
    return 0 if code == 0 and identical else 1


if __name__ == "__main__":
    sys.exit(main())

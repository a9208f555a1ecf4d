"""Where the benchmarks' results go, how they are named, and the machine each records.

Every run writes a new file, ``benchmarks/results/<section>/<UTC>_<commit>.json``: ``<section>`` is what the file
holds (``overhead``, ``goodput``, ``scale_kills``; ``benchmarks/README.md`` lists them), ``<UTC>`` the run's start
(``20261127T155502Z``), ``<commit>`` the checkout's short commit, and an optional ``_<label>`` sets a variant apart
(``..._make_bench.json``). A file that exists is never replaced: every verdict is over every kept run. Inside, the
key ``"machine"`` records where it ran (``machine()``: CPU model, core count, GPU if any, kernel, python, torch,
torchft, lightning), ``"commit"`` the commit and ``"dirty"`` whether the checkout had changes (``header()``).
Renderers read a section with ``every`` (all kept runs) or ``newest``; their own outputs have fixed names
(``latest.md``), rewritten each time.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common.run_util import BENCH, REPO

RESULTS = BENCH / "results"


def section_dir(section: str, root: Path = RESULTS) -> Path:
    return root / section


def every(section: str, root: Path = RESULTS, pattern: str = "*.json") -> list[Path]:
    """Every kept results file of ``section``, oldest first (the names start with the UTC time)."""
    return sorted(section_dir(section, root).glob(pattern))


def newest(section: str, root: Path = RESULTS, pattern: str = "*.json") -> Path | None:
    files = every(section, root, pattern)
    return files[-1] if files else None


def label_of(path: Path) -> str:
    """The label of ``<UTC>_<commit>_<label>.json`` (``""`` for none)."""
    parts = path.stem.split("_", 2)
    return parts[2] if len(parts) == 3 else ""


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str:
    """The checkout's short commit; where there is no git (a copied tree on a lent GPU), ``LIGHTNING_FT_COMMIT`` or
    ``unknown``."""
    return _git("rev-parse", "--short", "HEAD") or os.environ.get("LIGHTNING_FT_COMMIT") or "unknown"


def dirty() -> bool | None:
    """Whether the checkout has uncommitted changes (``None``: unknown)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def new_results_file(section: str, out: Path | None = None, label: str | None = None, suffix: str = ".json") -> Path:
    """``out``, or ``results/<section>/<UTC>_<commit>[_<label>]<suffix>``; refuses a file that exists (every run is
    kept, so no run replaces an earlier one's file). The folder is created."""
    if out is None:
        name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{commit()}" + (f"_{label}" if label else "")
        out = section_dir(section) / f"{name}{suffix}"
    if out.exists():
        raise SystemExit(f"{out} exists: every run is kept, choose a new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def header() -> dict[str, Any]:
    """What every results file records besides its figures: the machine, the commit, whether the tree was dirty."""
    return {"machine": machine(), "commit": commit(), "dirty": dirty()}


def machine() -> dict[str, Any]:
    """Where a run ran: CPU model and count, the GPUs (``None`` without), kernel, python, torch, torchft, lightning."""
    import lightning
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "gpu": ", ".join(gpus) or None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchft": torchft_distribution(),
        "lightning": lightning.__version__,
        "kernel": platform.release(),
    }


def torchft_distribution() -> str:
    """The installed torchft's distribution and version: ``torchft`` releases, or the ``torchft-nightly`` builds."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchft", "torchft-nightly"):
        try:
            return version(name) if name == "torchft" else f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"

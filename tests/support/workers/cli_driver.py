"""Run ``examples/train.py``'s LightningCLI once per config file, in one process, and report each outcome.

The invalid-YAML tests need a dozen CLI runs that all fail before training starts. Each run in its own interpreter
would spend most of its time importing torch and Lightning, so this driver imports them once and then does what
the interpreter would do for each run: the CLI's own ``SystemExit`` code (jsonargparse's usage errors exit 2), or
exit code 1 and the traceback for an exception that escapes ``main()``. One JSON line per config on stdout:
``{"config": ..., "exit_code": ..., "stderr": ...}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "train.py"


def run_cli(main: object, config: str) -> tuple[int, str]:
    """One ``train.py fit --config=<config>`` run: (exit code, what it wrote to stderr)."""
    stderr = io.StringIO()
    sys.argv = [str(TRAIN), "fit", f"--config={config}"]
    with contextlib.redirect_stderr(stderr):
        try:
            main()  # type: ignore[operator]
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
    return code, stderr.getvalue()


def main() -> None:
    cli_main = runpy.run_path(str(TRAIN), run_name="cli_driver")["main"]
    for config in sys.argv[1:]:
        code, stderr = run_cli(cli_main, config)
        print(json.dumps({"config": config, "exit_code": code, "stderr": stderr}), flush=True)


if __name__ == "__main__":
    main()

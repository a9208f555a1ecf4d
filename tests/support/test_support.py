"""The test helpers' own edge cases: what a real-process test reads about a process that is exiting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import process_gone


def test_a_process_reaped_between_the_open_and_the_read_of_its_status_counts_as_gone(monkeypatch):
    """``/proc/<pid>/status`` can open while the process lives and fail with ESRCH on the read once it is reaped:
    the process is gone, not an error of the test that asked."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(live.pid)

        def reaped(self: Path, *args: object, **kwargs: object) -> str:
            raise ProcessLookupError(3, "No such process")

        monkeypatch.setattr(Path, "read_text", reaped)
        assert process_gone(live.pid)
    finally:
        live.kill()
        live.wait()

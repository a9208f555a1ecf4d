"""torchrun's elastic agent as each replica group runs it: ``python -m lightning_ft_job.torchrun_agent <its args>``.

It is ``torch.distributed.run``'s own ``main``, unchanged, with one difference at the very end: once ``main`` has
returned (the group finished) or raised (its group failed after its last restart, or it was signalled, with
torchrun's own traceback printed), the process exits with the status Python would give, but without the
interpreter's teardown of torch. That teardown frees hundreds of thousands of objects for nothing (a measurable share
of a small machine's CPU, at the moment every group of a job ends at once) and runs the destructors of torchrun's
rendezvous (its store server among them) after the agent's work is done. Everything else still runs first: the joins
of non-daemon threads and every atexit hook registered by torch (this one is registered before torch is imported, so
it runs last). Flushing an output that is a pipe to a launcher that died cannot stop the exit either.

With ``LIGHTNING_FT_STACKS_DIR`` set, ``kill -USR1 <agent pid>`` writes every thread of the agent's Python stack to
``<dir>/agent-<pid>.stacks`` (:mod:`faulthandler`, which works while the interpreter is stuck in C code): what an
agent that does not end is doing, when its output, a pipe to a launcher that died, is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import IO

from lightning_ft_job.environment import ENV_STACKS_DIR

_stacks_file: list[IO[str]] = []  # kept open for the process's life: faulthandler writes to its descriptor


def _exit_without_teardown(status: list[int]) -> None:
    if not status:  # main neither returned nor raised (the agent's import failed, say): the interpreter's own exit
        return
    for stream in (sys.stdout, sys.stderr):
        # A pipe whose reader is gone, or a closed stream: nothing more to say there.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status[0])


def _exit_status(stop: SystemExit) -> int:
    """The status Python gives ``raise SystemExit(code)``: 0 for None, the number, else 1 (it prints the code)."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def _dump_stacks_on_sigusr1() -> None:
    directory = os.environ.get(ENV_STACKS_DIR, "").strip()
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    _stacks_file.append(open(Path(directory) / f"agent-{os.getpid()}.stacks", "w"))  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks_file[0], all_threads=True)


def main() -> None:
    _dump_stacks_on_sigusr1()
    status: list[int] = []
    atexit.register(_exit_without_teardown, status)
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except SystemExit as stop:
        status.append(_exit_status(stop))
        raise
    except KeyboardInterrupt:
        status.append(128 + signal.SIGINT)
        raise
    except BaseException:  # printed as an uncaught exception, then exit 1, as Python would
        status.append(1)
        raise
    status.append(0)


if __name__ == "__main__":
    main()

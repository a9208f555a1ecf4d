"""torchrun's elastic agent as each replica group runs it: ``python -m lightning_ft_job.torchrun_agent <its args>``.

It is ``torch.distributed.run``'s own ``main``, unchanged, with one difference at the very end: once ``main`` has
returned (the group finished), the process exits without the interpreter's teardown of torch, which frees hundreds of
thousands of objects for nothing (a measurable share of a small machine's CPU), at the moment every
group of a job ends at once. Everything else still runs first: the joins of non-daemon threads and every atexit hook
registered by torch (this one is registered before torch is imported, so it runs last). An agent whose ``main``
raised (its group failed after its last restart, or it was signalled) goes through the normal exit, with torchrun's
own traceback and exit code.
"""

from __future__ import annotations

import atexit
import os
import sys


def _exit_without_teardown_once_main_returned(returned: list[bool]) -> None:
    if returned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    returned: list[bool] = []
    atexit.register(_exit_without_teardown_once_main_returned, returned)
    from torch.distributed.run import main as torchrun_main

    torchrun_main()
    returned.append(True)


if __name__ == "__main__":
    main()

"""How many worker threads each of torchft's RPC runtimes runs in a training process.

torchft runs its ManagerServer and every RPC client on a tokio runtime of its own, each with
``min(4, available CPUs)`` worker threads unless ``TOKIO_WORKER_THREADS`` says otherwise (torchft's ``src/lib.rs``,
``num_threads``). A training process's runtimes carry a handful of RPCs per step (the quorum and, in a group of
several processes, the vote) that wait on the network, not on CPU; but every extra worker is woken, looks for work
and parks again, on the same cores as training. With one worker each, torchft's ManagerServer threads took 0.57 and
0.59 ms of the job's CPU per step instead of 0.74 and 0.80 ms (two groups of one process, a 0.26 M MLP, 2 vCPUs,
AMD EPYC; ``docs/benchmarks.md``). One worker is also what torchft itself runs on a one-CPU machine.

The setting applies only while lightning-ft builds the Manager and its clients (the variable is read when a runtime
is built): nothing else in the process, and none of its child processes (data loader workers), sees it. A user who
sets ``TOKIO_WORKER_THREADS`` keeps their value, here and everywhere. The lighthouse, which serves every group of the
job, keeps torchft's default.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

#: The environment variable torchft's runtimes read for their worker thread count (tokio's own name).
THREADS_VARIABLE = "TOKIO_WORKER_THREADS"
#: Worker threads of each torchft runtime that lightning-ft builds in a training process.
RUNTIME_THREADS = 1


@contextmanager
def torchft_runtime_threads(threads: int = RUNTIME_THREADS) -> Iterator[None]:
    """While torchft builds runtimes inside the block, each gets ``threads`` workers, unless the user has set
    ``TOKIO_WORKER_THREADS``; the environment is as it was afterwards."""
    if THREADS_VARIABLE in os.environ:
        yield
        return
    os.environ[THREADS_VARIABLE] = str(threads)
    try:
        yield
    finally:
        os.environ.pop(THREADS_VARIABLE, None)

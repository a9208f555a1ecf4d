"""One deadline for a step's cross-group collectives on NCCL, instead of torchft's timers around each one.

torchft's reconfigurable NCCL process group bounds every collective with timers on torchft's timeout thread: one
around the launch and two more when its future completes (``_WorkAcceleratorTimeout``), and ``Manager.wrap_future``
adds a fourth. With DDP's buckets that is four wake-ups of that thread per bucket (36 per step for a 134 M MLP), each
taking the GIL from the backward pass that launches the next bucket.

Here the DDP hook launches each bucket's allreduce on the NCCL group under torchft's wrapper (its ``parent``), and
one timer per step bounds them all. NCCL runs a communicator's collectives in order on one stream. When the hook has
launched the step's last bucket, :meth:`StepDeadline.arm` makes the current stream wait for that bucket's averaged
result (a CUDA future's ``wait()``: the stream waits, the host does not; DDP's own end of the backward pass does the
same for every bucket), then records a CUDA event on it with torchft's ``stream_timeout``: the event completes only
once every collective of the step has, which is torchft's own pattern for a collective's wait
(``_WorkAcceleratorTimeout.wait``). If it has not within the process group's timeout (``FTStrategy(timeout=...)``),
the process group is aborted exactly as torchft's own timer would abort it: torchft's ``errored()`` reports it, the
vote says no, and the next quorum builds a new NCCL group. The hang bound stays the timeout, counted from the last
bucket.

What the wrapper's per-collective timer around the launch covered, a launch that blocks on the host, cannot happen
on these communicators: torchft makes them non-blocking (``config.blocking = False``), and torch bounds a
non-blocking communicator's wait by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, which torchft sets to the same timeout.

Gloo needs none of this: each Gloo operation carries the timeout itself (and lightning-ft's Gloo group gives up one
the others left behind, :mod:`lightning_ft.process_group.left_behind`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from torchft.futures import stream_timeout

log = logging.getLogger("lightning.pytorch.lightning_ft")


class StepDeadline:
    """Launches a step's cross-group allreduces straight on the NCCL group, and bounds them with one timer.

    Args:
        process_group: torchft's reconfigurable NCCL group, the Manager's for its whole life (its inner NCCL group,
            ``parent``, changes at each reconfiguration).
        timeout: How long the step's collectives may take, counted from the last bucket: the process group's own.
    """

    def __init__(self, process_group: Any, timeout: timedelta) -> None:
        self.process_group = process_group
        self.timeout = timeout
        self._last: torch.futures.Future[Any] | None = None
        self.armed = 0  # timers armed so far, one per step that launched a collective

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """An allreduce on the NCCL group of the current quorum, without the wrapper's timers."""
        return self.process_group.parent.allreduce(tensors, opts)

    def launched(self, completion: torch.futures.Future[Any]) -> None:
        """``completion`` (the bucket's averaged result, which waits for its allreduce) is the step's latest."""
        self._last = completion

    def arm(self) -> None:
        """The step's last bucket is launched: one timer on the whole step's collectives, if any was launched.

        The current stream first waits for the last completion (which waits for the step's last allreduce, and so for
        all of them); the timer's CUDA event is recorded after that wait.
        """
        last, self._last = self._last, None
        if last is None:
            return
        process_group, timeout = self.process_group, self.timeout

        def abort() -> None:  # on torchft's timeout thread, which must not block: torchft's own timer does the same
            log.error(
                "lightning-ft: a cross-group collective did not finish within %s; aborting the cross-group process "
                "group (this step will not commit, the next quorum builds a new one)",
                timeout,
            )
            process_group.abort()

        self.armed += 1
        if not last.done():  # not NCCL's future, complete at launch: time the stream from its completion instead
            last.add_done_callback(lambda _: stream_timeout(abort, timeout))
            return
        try:
            last.wait()  # a CUDA future: the current stream waits for it, the host does not
        except Exception:  # the completion reported its own failure to the Manager (the step will not commit)
            return
        stream_timeout(abort, timeout)

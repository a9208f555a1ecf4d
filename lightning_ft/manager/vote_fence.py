"""What torchft's vote waits for on a GPU: the step's cross-group work and the vote's own inputs, not the kernels
queued after them.

torchft's ``Manager.should_commit`` synchronizes the *current stream* before it votes (``torchft.utils.synchronize``):
an NCCL error must be seen, and the averaged gradient be final, before the group says yes. On the default stream that
wait also covers everything queued after the backward pass (gradient clipping, ``on_before_optimizer_step``'s work),
which the vote does not need: the GPU drains, then idles while the host votes and the optimizer launches its first
kernels (about 0.6 ms of a 13-ms bf16 step on an H200, ``docs/benchmarks.md``).

:class:`VoteFence` marks the point the vote does need. At the end of a backward pass whose gradients crossed groups
(``FTStrategy.backward``), DDP has made the stream wait for every bucket's averaged result, the vote's inputs
(the non-finite flags, the loss) are queued for the host, and :meth:`VoteFence.mark` records one CUDA event. The vote
then runs with a side stream as the current stream (:meth:`VoteFence.voting`): the side stream waits for that event
only, so torchft's sync returns once the cross-group work is done while clipping still runs on the GPU. Afterwards the
default stream waits for the side stream, so whatever the vote queued stays ordered before the optimizer's update.

A failed or hung collective is seen exactly as before: the mark follows every bucket, so the sync still waits for
all of the step's collectives, or for the step's deadline to abort them
(:mod:`lightning_ft.process_group.step_deadline`).
The buffers' cross-group average (:mod:`lightning_ft.step.buffers`) starts at the backward pass's first bucket, on
the same NCCL communicator, so it is done by the mark as well. The step protocol does not use the fence while this
replica heals (torchft applies the received state inside the vote). A torchft whose vote synchronizes more (the whole
device) is still correct here, only not faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class VoteFence:
    """The point of a step's work on ``device`` that its vote waits for, and the side stream that waits for it only.

    Args:
        device: The CUDA device the step runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._event = torch.cuda.Event()
        self._stream: torch.cuda.Stream | None = None
        self._marked = False
        self.votes_fenced = 0  # votes that waited for the mark only

    @property
    def marked(self) -> bool:
        """Whether the open step has a mark that its vote may wait for instead of the whole stream."""
        return self._marked

    def mark(self) -> None:
        """Everything the vote waits for is queued on the current stream: record the point (a later mark replaces
        it)."""
        self._event.record(torch.cuda.current_stream(self.device))
        self._marked = True

    def clear(self) -> None:
        """The open step's vote waits for the whole stream after all (or the step closed without one)."""
        self._marked = False

    @contextmanager
    def voting(self) -> Iterator[None]:
        """The vote's context: with a mark, the side stream (waiting for the mark only) is the current stream inside
        it, and the default stream waits for the side stream when it ends, whatever happened; without one, nothing
        changes. The mark is used once."""
        if not self._marked:
            yield
            return
        self._marked = False
        main = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream
        side.wait_event(self._event)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            main.wait_stream(side)
        self.votes_fenced += 1

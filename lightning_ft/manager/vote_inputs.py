"""This process's own inputs to the commit vote, read after torchft has synchronized the device for it.

torchft's ``Manager.should_commit`` starts by synchronizing the device (on an accelerator it waits for every kernel
queued so far: an NCCL error must be seen before the vote), then asks its client for the group's decision. That one
wait is the step's host-device sync. Anything else this process must read from the device for the step (whether the
averaged gradient is finite, the step's loss for the event log) is read in between: the kernels that produced it
have finished, so the read waits for nothing. Read before the vote instead, each would be a sync of its own, and one
read after the optimizer's launches makes the host wait for the optimizer's kernels before it can queue the next
batch's work (``docs/benchmarks.md``).

:class:`VoteInputs` wraps the Manager's client (outermost, :func:`lightning_ft.manager.builder.composed_client`): the
client's ``should_commit`` is the first thing torchft calls after its sync. :func:`should_commit_reading` is the one
entry point: it hands the reader to the client for the next vote only. A check made at every vote, every path's
(the job's last step: :mod:`lightning_ft.start.last_step`), is installed with :meth:`VoteInputs.check_each_vote`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torchft import Manager

from lightning_ft.manager.internals import manager_client

#: Given this process's vote so far (``True``: nothing went wrong), reads what it needs from the device and returns
#: the vote it casts. A ``False`` it returns must come with an error reported to the Manager (the step is lost).
VoteReader = Callable[[bool], bool]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, queued now on the current stream without waiting for it; valid to read
    once the vote has synchronized the device (a reader of :func:`should_commit_reading` may read it).

    On an accelerator the copy lands in pinned memory, so reading it afterwards is a plain host read: no device call
    at all. On the host it is a clone (the original may be changed before the vote, as the non-finite flags are).
    """
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    return tensor.detach().to("cpu", non_blocking=True)


class VoteInputs:
    """The Manager's client, letting this process read its own vote inputs once torchft has synchronized the device."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._reader: VoteReader | None = None
        self._each_vote: Callable[[], bool] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def read_at_next_vote(self, reader: VoteReader | None) -> None:
        self._reader = reader

    def check_each_vote(self, check: Callable[[], bool] | None) -> None:
        """Call ``check()`` at every vote, whatever the vote so far (it may broadcast inside the group, so every rank
        must call it): ``False`` votes not to commit (it reports its error to the Manager itself); it may raise."""
        self._each_vote = check

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """Cast this process's vote: torchft's, the vote check's and then the reader's say."""
        if self._each_vote is not None:
            should_commit = self._each_vote() and should_commit
        reader, self._reader = self._reader, None
        if reader is not None:
            should_commit = reader(should_commit)
        return self._client.should_commit(group_rank, step, should_commit, timeout)


def should_commit_reading(manager: Manager, reader: VoteReader) -> bool:
    """``manager.should_commit()``, with ``reader`` read after its device sync and before the vote is cast.

    A Manager whose client is not a :class:`VoteInputs` (built by hand) still gets a correct vote: the device is
    synchronized and the reader runs first, at the price of a sync of its own.
    """
    client = manager_client(manager)
    if not isinstance(client, VoteInputs):
        if torch.accelerator.is_available():  # what torchft's vote does first; host copies are valid after it
            torch.accelerator.synchronize()
        reader(manager.errored() is None)
        return manager.should_commit()
    client.read_at_next_vote(reader)
    try:
        return manager.should_commit()
    finally:  # a vote that failed before reaching the client must not leave its reader to the next one
        client.read_at_next_vote(None)

"""One rank of a two-process torchft Gloo process group, for tests/processes/test_left_behind.py.

``silent``: joins the process group and never calls a collective, so its peer's allreduce stays pending for real;
it exits when its stdin closes. ``stuck``: starts an allreduce that the silent rank never joins, lets
:class:`LeftBehindWatch` give it up (a moved-on signal that reports a newer quorum), sets the process group aside,
configures a new one-rank group for the next "quorum", runs an allreduce on it, prints ``DONE`` and exits, all while
the first allreduce is still pending in Gloo (its timeout is far longer than the test waits).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
from torchft import ProcessGroupGloo

from lightning_ft.manager.internals import set_aside_process_group
from lightning_ft.manager.moved_on import MovedOn
from lightning_ft.step.left_behind import CollectiveLeftBehindError, LeftBehindWatch

GLOO_TIMEOUT = timedelta(seconds=600)


class FakeManager:
    """What the watch and set_aside_process_group use of torchft's Manager (also the unit tests' fake)."""

    def __init__(self, quorum_id: int = 1, pg: Any = None) -> None:
        self._pg = pg
        self.latest_quorum_id = quorum_id
        self.reported: list[Exception] = []

    def quorum_id(self) -> int:
        return self.latest_quorum_id

    def errored(self) -> Exception | None:
        return self.reported[0] if self.reported else None

    def report_error(self, error: Exception) -> None:
        self.reported.append(error)

    def current_step(self) -> int:
        return 7


def main(role: str, store: str) -> None:
    pg = ProcessGroupGloo(timeout=GLOO_TIMEOUT)
    pg.configure(f"{store}/quorum1", "replica", rank=0 if role == "stuck" else 1, world_size=2, quorum_id=1)
    if role == "silent":
        sys.stdin.read()
        return
    manager = FakeManager(pg=pg)
    watch = LeftBehindWatch(manager, lambda: MovedOn(2), check_after=0.2, interval=0.1)
    buffer = torch.ones(1 << 20)
    work = pg.allreduce([buffer], torch.distributed.AllreduceOptions())
    given_up = watch.track(work.get_future(), buffer, lambda done: done.value()[0])
    given_up.wait()
    watch.shutdown()
    assert isinstance(manager.reported[0], CollectiveLeftBehindError), manager.reported
    assert not work.is_completed(), "the first allreduce must still be pending in Gloo"
    assert set_aside_process_group(manager)
    pg.configure(f"{store}/quorum2", "replica", rank=0, world_size=1, quorum_id=2)
    fresh = torch.full((4,), 3.0)
    pg.allreduce([fresh], torch.distributed.AllreduceOptions()).wait()
    assert torch.equal(fresh, torch.full((4,), 3.0)), fresh
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

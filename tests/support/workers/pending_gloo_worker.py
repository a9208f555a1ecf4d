"""One rank of a two-process lightning-ft Gloo process group, for tests/process_group/test_left_behind.py.

``silent``: joins the process group and never calls a collective, so its peer's allreduce stays pending for real;
it exits when its stdin closes. ``stuck``: starts an allreduce that the silent rank never joins, lets the process
group's :class:`LeftBehindWatch` give it up (a moved-on signal that reports a newer quorum), configures a new
one-rank group for the next "quorum" (which sets the old group aside instead of aborting it), runs an allreduce on
it, prints ``DONE`` and exits, all while the first allreduce is still pending in Gloo (its timeout is far longer
than the test waits).
"""

from __future__ import annotations

import functools
import sys
from datetime import timedelta
from pathlib import Path

import torch

from lightning_ft.process_group import arrival, quorum_store
from lightning_ft.process_group.left_behind import CollectiveLeftBehindError, LeftBehindWatch
from lightning_ft.process_group.moved_on import MovedOn
from lightning_ft.process_group.quorum_store import StoreCheckedProcessGroupGloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support, for the helper below
from torchft_groups import reconfigure_without_manager

GLOO_TIMEOUT = timedelta(seconds=600)
# What is under test is an allreduce left pending, not the members' arrival: the test starts the two ranks one after
# the other, and on a busy machine the second one's start-up can outlast arrival's 1-s grace (seen in CI: the quorum
# was given up before the allreduce). Here every member is alive, so the rendezvous waits for it.
quorum_store.wait_for_every_member = functools.partial(arrival.wait_for_every_member, grace=120.0)


def main(role: str, store: str) -> None:
    pg = StoreCheckedProcessGroupGloo(timeout=GLOO_TIMEOUT)
    reconfigure_without_manager(pg, store, rank=0 if role == "stuck" else 1, world_size=2, quorum_id=1)
    if role == "silent":
        sys.stdin.read()
        return
    pg.__dict__["left_behind_watch"] = LeftBehindWatch(lambda: MovedOn(2), check_after=0.2, interval=0.1)
    buffer = torch.ones(1 << 20)
    work = pg.allreduce([buffer], torch.distributed.AllreduceOptions())
    try:
        work.wait()
    except CollectiveLeftBehindError:
        pass
    else:
        raise AssertionError("the allreduce the silent rank never joined completed")
    pending_group = pg._pg
    reconfigure_without_manager(pg, store, rank=0, world_size=1, quorum_id=2)
    assert pg._pg is not pending_group, "the old group must be set aside, the new one configured"
    fresh = torch.full((4,), 3.0)
    pg.allreduce([fresh], torch.distributed.AllreduceOptions()).wait()
    assert torch.equal(fresh, torch.full((4,), 3.0)), fresh
    pg.left_behind_watch.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

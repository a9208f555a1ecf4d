"""A cross-group process group joined without a Manager, for the tests and workers that stand in for one."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torchft.process_group

from lightning_ft.process_group.torchft_api import CONFIGURE_API


def reconfigure_without_manager(
    process_group: Any, store: str, rank: int, world_size: int, quorum_id: int, timeout: timedelta | None = None
) -> None:
    """Join a quorum's process group through the TCPStore at ``store`` (``host:port``) without a Manager, with
    whichever API the installed torchft has; the prefix is ``/torchft/<quorum_id>`` either way. For tests that stand
    in for the Manager; the other members' handles are placeholders, since only this member's position
    in the list (its rank) and the first member's store matter to the rendezvous."""
    if CONFIGURE_API:
        process_group.configure(f"{store}/torchft/{quorum_id}", "replica", rank, world_size, quorum_id=quorum_id)
        return
    own = process_group._handle_id()
    options = torchft.process_group.ReconfigureOptions()
    options.uuid = quorum_id
    options.handles = [
        json.dumps({"id": own if peer == rank else f"peer-{peer}", "store": store, "global_rank": None})
        for peer in range(world_size)
    ]
    options.timeout = timeout or timedelta(seconds=60)
    process_group.reconfigure(options).wait()

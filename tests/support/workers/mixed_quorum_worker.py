"""One replica group's real Manager asking for one kind of quorum, then using it the way lightning-ft does.

``section``: a reduction in a sync section, which asks the lighthouse for a quorum of its own (``allow_heal=False``),
then sends the section's handshake and the value. ``step``: a training step's quorum, then one bucket of gradients
through the DDP comm hook's cross-group average (577 floats, the test worker's model). Two of them, started against
one lighthouse that needs both, meet in one quorum of mixed kinds: what a survivor retrying a section and another
already in its next step get after a third group died inside the section's collective.

Usage: ``mixed_quorum_worker.py ROLE GROUP LIGHTHOUSE``; prints one JSON line with what this member got.
"""

from __future__ import annotations

import json
import sys

import torch

from lightning_ft import FTStrategy
from lightning_ft.manager import build_manager
from lightning_ft.step.collectives import CrossGroupCollectives
from lightning_ft.step.gradient_hooks import FTCommState, cross_group_average


def main() -> None:
    role, group, lighthouse = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    strategy = FTStrategy(
        replica_group_id=group,
        num_replica_groups=2,
        lighthouse=lighthouse,
        init_sync=False,  # nothing to heal: these Managers hold no state
        timeout=20,
        quorum_timeout=30,
        connect_timeout=10,
    )
    handle = build_manager(strategy.settings, 0, 1, torch.device("cpu"))
    manager = handle.manager
    result: dict[str, object] = {"role": role}
    if role == "section":
        collectives = CrossGroupCollectives(manager, None, position=lambda: (7, 0, 3), max_attempts=1)
        collectives.open_section()
        result["value"] = float(collectives.reduce(torch.tensor(float(group + 1)), "sum"))
    else:
        manager.start_quorum()
        gradient = torch.full((577,), float(group + 1))
        averaged = cross_group_average(FTCommState(manager, None, 1), gradient).wait()
        result["value"] = float(averaged[0])
    error = manager.errored()
    result["error"] = None if error is None else type(error.original_exception).__name__
    print(json.dumps(result), flush=True)
    handle.shutdown()


if __name__ == "__main__":
    main()

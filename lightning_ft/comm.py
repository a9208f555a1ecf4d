"""The DDP communication hook that averages gradients inside the group and then across groups.

Why a hook of our own instead of ``torchft.ddp.DistributedDataParallel``:

* torchft 0.2.0's hook asserts on an internal future (``assert fut._fut``) that is ``None`` when a peer died in the
  middle of the allreduce, so the *survivor* crashes exactly when it should carry on. Here the error is left with
  the Manager, which already recorded it (``should_commit()`` will then say no), and the hook returns a completed
  future. The bucket's contents are garbage in that case, which is fine: the step is not committed.
* torchft's cross-group process group only links equal group ranks, so a group of several processes must reduce
  inside the group first, on the group's own process group, and only then across groups.
"""

# No `from __future__ import annotations` here: torch's DDP inspects the hook's annotations at registration and
# requires the real GradBucket / Future[Tensor] objects, not strings.
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchft import Manager


@dataclass
class FTCommState:
    """What the hook needs: the Manager for the cross-group step and the group's own process group."""

    manager: Manager
    group: dist.ProcessGroup | None
    group_world_size: int
    before_allreduce: Callable[[], None] = lambda: None


def ft_allreduce_hook(state: FTCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group (sum / group size), then over participating groups (Manager AVG).

    An intra-group failure raises: the group is the unit of failure and is restarted whole. A cross-group failure
    never raises: the Manager swallows and records it, and the step will not commit.
    """
    state.before_allreduce()
    buffer = bucket.buffer()
    if state.group_world_size > 1:
        dist.all_reduce(buffer, group=state.group)
        buffer.div_(state.group_world_size)
    state.manager.allreduce(buffer).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done

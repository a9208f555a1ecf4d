"""The communication hooks that average gradients across replica groups: one for DDP, one for FSDP2.

Why a DDP hook of our own instead of ``torchft.ddp.DistributedDataParallel``:

* torchft 0.2.0's hook asserts on an internal future (``assert fut._fut``) that is ``None`` when a peer died in the
  middle of the allreduce, so the *survivor* crashes exactly when it should carry on. Here the error is left with
  the Manager, which already recorded it (``should_commit()`` will then say no), and the hook returns a completed
  future. The bucket's contents are garbage in that case, which is fine: the step is not committed.
* torchft's cross-group process group only links equal group ranks, so a group of several processes must reduce
  inside the group first, on the group's own process group, and only then across groups.

With FSDP2 (``data_parallel="fsdp"``) the group reduce-scatters instead, and :func:`fsdp_cross_group_hook` is FSDP2's
all-reduce hook: it averages each rank's reduced shard with the same shard of the other groups. That is the HSDP
pattern of torchft 0.2.0 (TorchTitan's ``set_all_reduce_hook`` over torchft's ``ManagedProcessGroup``, whose
``allreduce`` is ``Manager.allreduce``); the hook calls the Manager directly so that it can check the step's quorum
first, as the DDP hook does.
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


def fsdp_cross_group_hook(
    manager: Manager, before_allreduce: Callable[[], None] = lambda: None
) -> Callable[[torch.Tensor], None]:
    """FSDP2's all-reduce hook: average this rank's reduce-scattered gradient shard across groups, in place.

    FSDP2 calls it once per ``fully_shard`` parameter group in backward, with the group-averaged flat shard of that
    parameter group (``set_all_reduce_hook``). Rank *r* of every group holds the same shard, and torchft's
    cross-group process group links exactly the rank-*r* processes, so the Manager's average is the job-wide
    average. As with DDP, a cross-group failure never raises: the Manager records it, the shard holds garbage, and
    the step does not commit.
    """

    def hook(reduce_output: torch.Tensor) -> None:
        before_allreduce()
        manager.allreduce(reduce_output).wait()

    return hook

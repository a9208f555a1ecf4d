"""The fault-tolerance callbacks. FTStrategy adds each one that the user has not supplied; each can be replaced.

* :class:`QuorumCallback` opens each optimizer step's quorum before the other callbacks' batch start (the step owner,
  :mod:`lightning_ft.step.owner`, keeps Lightning's step counters on committed steps).
* :class:`SyncCallback` takes its place with ``algorithm="local_sgd"``: a cross-group sync every ``sync_every``
  inner steps.
* :class:`StateTransferCallback` hands the whole training state to the Manager for live healing.
* :class:`ManagerCheckpointCallback` stores the Manager's committed-step state in Lightning checkpoints.
* :class:`ReplicaConsistencyCheck` compares fingerprints of the replicas' whole training state every N committed
  steps and at the last one, and makes a diverged group heal (added with ``algorithm="ddp"``).
* :class:`FailureInjector` (never added by the strategy) rehearses failures: kill, raise, hang, slow down or NaN
  gradients on one replica at a chosen step.
* :class:`DataPositionCallback` keeps every group at its peers' loop position, in its own shard, after a heal or a
  resume.
* :class:`ExactlyOnceDataCallback` takes its place with ``data_mode="exactly_once"``: it ends each epoch at the
  committed step that consumed its permutation, in every group alike.
* :class:`DisjointDataCheck` compares the groups' first batches at the job's first step and warns when two groups
  read the same samples.
* :class:`FaultToleranceMonitor` logs the ``ft/`` metrics to the Trainer's loggers, shows ``replicas P/N`` in the
  progress bar, and records exceptions in the event log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_ft.callbacks.consistency import ReplicaConsistencyCheck, ReplicaDivergedError
from lightning_ft.callbacks.data_position import DataPositionCallback
from lightning_ft.callbacks.disjoint_data import DisjointDataCheck
from lightning_ft.callbacks.exactly_once import ExactlyOnceDataCallback
from lightning_ft.callbacks.failure_injector import Failure, FailureInjector, InjectedFailure
from lightning_ft.callbacks.manager_checkpoint import ManagerCheckpointCallback
from lightning_ft.callbacks.monitor import FaultToleranceMonitor
from lightning_ft.callbacks.quorum import QuorumCallback
from lightning_ft.callbacks.sync import SyncCallback
from lightning_ft.callbacks.transfer import StateTransferCallback

if TYPE_CHECKING:
    import lightning.pytorch as pl


def add_default_callbacks(
    trainer: pl.Trainer, *, semi_sync: bool, exactly_once: bool, several_groups: bool = True
) -> None:
    """Put the FT callbacks first, unless the user supplied their own instance (or a subclass) of each.

    The quorum callback (or, semi-synchronously, the sync callback) before DisjointDataCheck, which gathers on the
    step's quorum, so that the check runs at the job's first step; the step itself does not depend on this order (the
    step owner ends each step before any batch-end hook, and the data callback observes each step's start).
    """
    defaults = [
        ExactlyOnceDataCallback if exactly_once else DataPositionCallback,
        SyncCallback if semi_sync else QuorumCallback,
        DisjointDataCheck,
        StateTransferCallback,
        ManagerCheckpointCallback,
        FaultToleranceMonitor,
        # Semi-sync replicas differ between syncs by design; a job of one group has nothing to compare.
        *([ReplicaConsistencyCheck] if several_groups and not semi_sync else []),
    ]
    missing = [cls() for cls in defaults if not any(isinstance(cb, cls) for cb in trainer.callbacks)]  # type: ignore[attr-defined]  # set by Lightning's callback connector
    trainer.callbacks[0:0] = missing  # type: ignore[attr-defined]


__all__ = [
    "DataPositionCallback",
    "DisjointDataCheck",
    "ExactlyOnceDataCallback",
    "Failure",
    "FailureInjector",
    "FaultToleranceMonitor",
    "InjectedFailure",
    "ManagerCheckpointCallback",
    "QuorumCallback",
    "ReplicaConsistencyCheck",
    "ReplicaDivergedError",
    "StateTransferCallback",
    "SyncCallback",
    "add_default_callbacks",
]

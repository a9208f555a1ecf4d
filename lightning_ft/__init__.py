"""lightning-ft: per-step fault tolerance for PyTorch Lightning, built on torchft.

Importing this package registers ``"ft"`` in Lightning's strategy registry, so ``Trainer(strategy="ft")`` works.
"""

import os

# torchft's Rust side (a group's Manager server, an embedded lighthouse) logs about six INFO lines per step: 132 of the
# 160 lines of a 20-step run of one group. Its logger reads RUST_LOG once, when torchft's extension loads, which the
# imports below do; a RUST_LOG the user set wins (RUST_LOG=info shows them, as `lightning-ft launch --verbose` does).
os.environ.setdefault("RUST_LOG", "warn")

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ft.callbacks import (
    DataPositionCallback,
    Failure,
    FailureInjector,
    FaultToleranceMonitor,
    ManagerCheckpointCallback,
    QuorumCallback,
    ReplicaConsistencyCheck,
    StateTransferCallback,
)
from lightning_ft.callbacks.consistency import ReplicaDivergedError
from lightning_ft.checkpoint_io import UnreadableCheckpointError
from lightning_ft.data.job_shard import JobShard, job_shard
from lightning_ft.errors import (
    LightningFTError,
    NotAvailableError,
    StrategyRequiredError,
    UnsupportedArgumentError,
    UnsupportedModelError,
)
from lightning_ft.manager.builder import LighthouseUnreachableError
from lightning_ft.manager.group_claim import DuplicateReplicaGroupError
from lightning_ft.manager.lighthouse_outage import LighthouseUnavailableError
from lightning_ft.settings import FTConfigError
from lightning_ft.start.decision import JobAlreadyFinished, NoLivePeerError
from lightning_ft.start.job_settings import JobContractError
from lightning_ft.strategy import FTStrategy

__version__ = "0.1.0.dev0"

FTStrategy.register_strategies(StrategyRegistry)


__all__ = [
    "DataPositionCallback",
    "DuplicateReplicaGroupError",
    "FTConfigError",
    "FTStrategy",
    "Failure",
    "FailureInjector",
    "FaultToleranceMonitor",
    "JobAlreadyFinished",
    "JobContractError",
    "JobShard",
    "LighthouseUnavailableError",
    "LighthouseUnreachableError",
    "LightningFTError",
    "ManagerCheckpointCallback",
    "NoLivePeerError",
    "NotAvailableError",
    "QuorumCallback",
    "ReplicaConsistencyCheck",
    "ReplicaDivergedError",
    "StateTransferCallback",
    "StrategyRequiredError",
    "UnreadableCheckpointError",
    "UnsupportedArgumentError",
    "UnsupportedModelError",
    "__version__",
    "job_shard",
]

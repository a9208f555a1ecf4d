"""HSDP: FSDP2 sharding inside each replica group, torchft fault tolerance across groups (``data_parallel="fsdp"``).

See ``docs/hsdp.md``. One job per module:

* :mod:`~lightning_ft.hsdp.data_parallel`: ``data_parallel`` and the ``fsdp_*`` settings, validated up front;
* :mod:`~lightning_ft.hsdp.sharding`: the group's mesh, ``configure_model``'s layout or the auto-wrap policy;
* :mod:`~lightning_ft.hsdp.shards`: DTensors in the heal payload, as local shards;
* :mod:`~lightning_ft.hsdp.full_state`: full (unsharded) state for checkpoint files and fingerprints;
* :mod:`~lightning_ft.hsdp.cross_group`: each module's gradient shards averaged across groups, in one fixed order.
"""

from lightning_ft.hsdp.data_parallel import DATA_PARALLEL, DataParallelSettings, FSDPSettings, resolve_data_parallel

__all__ = ["DATA_PARALLEL", "DataParallelSettings", "FSDPSettings", "resolve_data_parallel"]

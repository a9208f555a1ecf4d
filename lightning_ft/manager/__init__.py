"""The torchft seam for the Manager: everything built around one replica group's Manager, and every touch of its
internals. torchft's process groups have the other half of the seam, :mod:`lightning_ft.process_group`.

Outside these two folders, lightning-ft uses torchft's public API and the public methods of their modules only; a
torchft upgrade is a diff there. The modules here:

* :mod:`.builder`: builds the group's Manager, its store, its cross-group process group, its checkpoint transport
  and its RPC client, composed once (:func:`~.builder.composed_client`).
* :mod:`.ft_manager`: :class:`FTManager`, torchft's Manager with heal vetting, the quorum id and quorum observers.
* :mod:`.internals`: the functions that read or change a Manager's private attributes.
* :mod:`.listeners`: where the Manager's listeners bind (its ManagerServer, the group's store, Gloo's address).
* :mod:`.telemetry`: the figures of quorum waits and heals (the heal's transport is
  :mod:`lightning_ft.manager.http_transport`).
* :mod:`.lighthouse_outage`, :mod:`.local_vote`: the client wrappers (ride out a lighthouse outage; a one-process
  group's vote in process).
* :mod:`.lighthouse_status`: the one reader of the lighthouse's HTML status page.

What torchft internals lightning-ft relies on, here and in :mod:`lightning_ft.process_group`, why, and the upstream
hook that would remove each: one row per name in :data:`.internals.PRIVATE_USES`, the one inventory, which
``tests/package/test_seams.py`` keeps exact (a private torchft name reached outside these two folders, or without its
row, fails it, as does a row that nothing reaches).

``docs/architecture.md`` places this folder in the whole.
"""

from lightning_ft.manager.builder import ManagerHandle, build_manager
from lightning_ft.manager.ft_manager import FTManager, QuorumObserver, QuorumSeen

__all__ = ["FTManager", "ManagerHandle", "QuorumObserver", "QuorumSeen", "build_manager"]

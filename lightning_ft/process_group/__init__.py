"""The cross-group process groups and their store: the torchft seam for torchft's process groups.

torchft reconfigures one process group between the replica groups at every quorum change. lightning-ft's classes of
it bound every wait that torchft leaves open (``docs/failure-semantics.md``):

* :mod:`.torchft_api`: which process-group API the installed torchft offers (0.2's ``configure`` or 0.3's
  ``reconfigure``), decided once, and the rendezvous read from it.
* :mod:`.quorum_store`: the process group classes (Gloo and NCCL): before each reconfiguration, the dead-store probe
  and every member's arrival (:mod:`.arrival`); during it, the watch over every operation (:mod:`.left_behind`), which
  gives up a collective that the other members have left, as read from the marker a group leaves in its old quorum's
  store when it moves on (:mod:`.moved_on`).

The torchft internals these modules rely on are listed, with the Manager's, in :mod:`lightning_ft.manager`.
"""

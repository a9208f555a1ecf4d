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

What torchft internals are relied on here and in :mod:`lightning_ft.process_group`, why, and which upstream hook would
remove each:

========================================== ============================================ ===============================
Internal                                   Why                                          Upstream hook that removes it
========================================== ============================================ ===============================
``Manager._pg``                            the comm hooks' allreduce, aborting or       an accessor for the process
                                           setting aside a failed group                 group the Manager was given
``Manager._quorum_id``,                    the quorum id and membership for events,     a quorum-id accessor / quorum
``_participating_replica_*``               telemetry and the left-behind watch          callback
``Manager._quorum_future``                 report each quorum once to observers; take   a quorum callback; a
                                           a known quorum without ``wait_quorum``'s     ``wait_quorum`` that enters its
                                           profiler range (several calls a step)        range only while it waits
``Manager._healing``,                      vet a received state before the first        a heal-check hook
``_pending_state_dict``,                   collective
``_apply_pending_state_dict``
``Manager._step``, ``_use_async_quorum``   with an asynchronous quorum, heal a job at   counting only contributing
                                           step 0 before the forward pass (torchft      groups in ``max_world_size``
                                           counts the healing groups, whose gradient
                                           it zeroes)
``Manager._client``                        ride out lighthouse outages; a one-process   client injection in the
                                           group's vote without an RPC                  constructor
``Manager._store`` (``MANAGER_ADDR_KEY``,  a second RPC client for the outage rescue;   a ManagerServer that answers
``REPLICA_ID_KEY``)                        this lifetime's replica id (group claim)     its pending requests; a public
                                                                                        ``replica_id()``
``ProcessGroupWrapper._pg``, ``._timeout`` set a group aside without Gloo's blocking    a ``reset()`` on the wrapper
                                           abort; the failure injector's stuck faults
``ProcessGroupWrapper._wrap_work``         watch every operation, and give up one the   a cancellable work, or Gloo
                                           other members have left (``left_behind``)    aborting a pending send
``ProcessGroupGloo._create_pg``,           bind Gloo to the advertised address; fail    a bind address option; a
``configure`` (0.2), ``reconfigure``,      a reconfiguration through a dead store at    pre-rendezvous hook
``_handle_id``, ``_rendezvous``,           once, wait for every member (:mod:`.listeners`,
``_rendezvous_store`` (0.3)                ``quorum_store``, ``torchft_api``);
                                           0.3: advertise the rendezvous store at the   a host option for the
                                           group's address                              rendezvous store
``DiLoCo._fragments``, a fragment's        DiLoCo's checkpoint (global parameters,      public ``fragments`` and
``_outer_optimizer`` and                   outer optimizer state); the final sync       ``outer_optimizer``; an
``_fragment_update_alpha``                 takes the global parameters as they are      update alpha per sync
``torchft.manager.ManagerServer``          bind the ManagerServer to the advertised     a bind address option
(swapped while the Manager is built)       address (:mod:`.listeners`)
lighthouse ``/status`` HTML                which groups heartbeat, the last quorum      a JSON status endpoint, or
                                           (:mod:`.lighthouse_status`)                  the quorum RPC's members
========================================== ============================================ ===============================

``docs/architecture.md`` places this folder in the whole.
"""

from lightning_ft.manager.builder import ManagerHandle, build_manager
from lightning_ft.manager.ft_manager import FTManager, QuorumObserver, QuorumSeen

__all__ = ["FTManager", "ManagerHandle", "QuorumObserver", "QuorumSeen", "build_manager"]

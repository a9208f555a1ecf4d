"""One optimizer step across replica groups: who opens its quorum, how gradients cross groups, how it commits.

* :mod:`.protocol`: :class:`~.protocol.StepProtocol`, the one owner of a step (open the quorum, require it before
  a collective, commit or reject, close), and :class:`~.protocol.CommitGatedOptimizer`, the optimizer the precision
  plugin steps, which steps only when the group's vote commits.
* :mod:`.gradient_hooks`: the DDP comm hook and the FSDP2 all-reduce hook that average gradients across groups.
* :mod:`.collectives`: job-wide reductions (metrics, ``reduce_boolean_decision``) in sync sections.

The strategy, the callbacks and the semi-synchronous syncs call the protocol; nothing else opens a step's quorum (a sync
section outside training steps opens its own, which never heals: :mod:`.collectives`).
"""

"""One optimizer step across replica groups: who opens its quorum, how gradients cross groups, how it commits.

* :mod:`.owner`: :class:`~.owner.StepOwner`, the one owner of an optimizer step in Lightning's loop: it begins the
  step (quorum, counters), steps the optimizer through the vote, ends the step before any batch-end hook, and gates
  the step-interval LR schedulers.
* :mod:`.protocol`: :class:`~.protocol.StepProtocol`, the step's exchange with the Manager (open the quorum, require
  it before a collective, commit or reject, close).
* :mod:`.gated_optimizer`: :class:`~.gated_optimizer.CommitGatedOptimizer`, the optimizer the precision plugin steps,
  which steps only when the group's vote commits.
* :mod:`.gradient_hooks`: the DDP comm hook and the FSDP2 all-reduce hook that average gradients across groups.
* :mod:`.left_out_parameters`: a parameter that a whole group left out of a step takes the job's average from its
  DDP bucket, as in every other group (``find_unused_parameters=True``).
* :mod:`.collectives`: job-wide reductions (metrics, ``reduce_boolean_decision``) in sync sections.

Per-step training goes through the owner; the semi-synchronous syncs call the protocol themselves. Nothing else opens a
step's quorum (a sync section outside training steps opens its own, which never heals: :mod:`.collectives`).
"""

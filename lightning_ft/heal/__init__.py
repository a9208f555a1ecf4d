"""Healing: what travels from a live peer to a group that is behind, how it travels, and how it is vetted and applied.

One heal, in order (``docs/architecture.md`` draws it):

* :mod:`.state`: what "the training state" is, Lightning's checkpoint (model, optimizers, schedulers, GradScaler,
  callbacks' state and whatever checkpoint hooks keep), built on the live peer and restored on the healing group;
  :mod:`.checkpoint_mode`: the strategy's part of it while a heal runs;
* :class:`~lightning_ft.callbacks.StateTransferCallback` registers that state with the Manager;
  :class:`~lightning_ft.callbacks.DataPositionCallback` adds the loop position, which the healing group applies to its
  own shard;
* :mod:`lightning_ft.manager.http_transport`: how it travels (torchft's HTTP transport, loaded with
  ``weights_only``, bound to the group's advertised address; beside the Manager, as it subclasses torchft's);
* :class:`~lightning_ft.manager.FTManager` vets what arrived (keys, shapes) before torchft applies it.
"""

"""What every process of a lightning-ft job agrees on, without Lightning or torch.

The launcher (:mod:`lightning_ft_cli`), the torchx component and the training processes (:mod:`lightning_ft`) must
use one spelling of the same few things: the environment variables a launcher sets for each replica group
(:mod:`.environment`), torchrun's arguments for a group (:mod:`.torchrun`), the event-log format (:mod:`.events`),
address rules (:mod:`.addresses`) and the embedded lighthouse (:mod:`.lighthouse_server`). They live here, below
both: the library and the command each import this layer, and neither imports the other.

Nothing here may import ``lightning_ft``, ``lightning_ft_cli``, Lightning or, at import time, torch: the launcher
starts in about 0.1 s because of it. ``tests/cli/test_cli.py`` checks it.
"""

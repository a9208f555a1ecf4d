"""The ``lightning-ft`` command, and the pieces of lightning-ft that need neither Lightning nor torch.

Why a package of its own: ``import lightning_ft`` registers ``"ft"`` in Lightning's strategy registry, and so imports
Lightning (about 1.8 s on a 2-core machine). The launcher only starts a lighthouse and N torchrun jobs; inside
``lightning_ft`` it paid that import before the first group could start, on every launch. Here it starts in about
0.1 s, and so do ``lightning-ft lighthouse`` and ``lightning-ft report``.

Beside the commands (:mod:`.main`, :mod:`.launch`, :mod:`.lighthouse`, :mod:`.report`), this package holds what the
launcher and the training processes must agree on, imported by both: the environment variables
(:mod:`.environment`), the event-log format (:mod:`.events`, :mod:`.timeline`), address rules (:mod:`.addresses`) and
the embedded lighthouse (:mod:`.lighthouse_server`). Nothing here may import ``lightning_ft``, Lightning or, at import
time, torch; ``tests/test_cli.py`` checks it.
"""

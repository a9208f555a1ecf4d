"""The ``lightning-ft`` command: ``launch``, ``lighthouse`` and ``report``.

Why a package of its own: ``import lightning_ft`` registers ``"ft"`` in Lightning's strategy registry, and so imports
Lightning (about 1.8 s on a 2-core machine). The launcher only starts a lighthouse and N torchrun jobs; it starts in
about 0.1 s, and so do ``lightning-ft lighthouse`` and ``lightning-ft report``.

It sits beside the library, not under it: what both need (environment variables, the event log, addresses, the
embedded lighthouse) is :mod:`lightning_ft_job`. Nothing here may import ``lightning_ft``, Lightning or, at import
time, torch; ``tests/cli/test_cli.py`` checks it.
"""

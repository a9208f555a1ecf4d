"""The ``lightning-ft`` command: ``lighthouse`` (torchft's lighthouse in the foreground) and ``launch``."""

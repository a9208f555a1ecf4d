"""torch's note that ``find_unused_parameters=True`` found no unused parameter, kept off the terminal where FTStrategy
chose the setting, and FTStrategy's reason said instead, once.

FTStrategy's default searches for unused parameters in a model whose gradients make several buckets
(:func:`lightning_ft.step.left_out_parameters.search_for_unused_parameters`): DDP then lays its buckets out in backward
order, a restarted group's first step included, and their allreduces overlap the backward pass. DDP's reducer notes,
once per process, that the search found nothing to do, and calls it a cost "which can adversely affect performance":
a warning about a setting the user never made. It says so from C++ (``TORCH_WARN_ONCE`` at the end of the first
forward pass whose search finds nothing), straight to the process's standard error, where no Python warning filter
reaches. So the first training forward pass of a process in which FTStrategy chose the setting runs with file
descriptor 2 captured, and what else was written meanwhile is written back, minus that note. A setting the user made
keeps torch's note.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from lightning.pytorch.utilities.rank_zero import rank_zero_info

log = logging.getLogger("lightning.pytorch.lightning_ft")

# The start of torch's note (torch/csrc/distributed/c10d/reducer.cpp, search_unused_parameters).
TORCH_NOTE = b"find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"
WHY = (
    "lightning-ft: FTStrategy's default searches this model for unused parameters (find_unused_parameters=True): its "
    "gradients make several buckets, whose allreduces then overlap the backward pass; set it to False to skip the "
    "search (docs/configuration.md)."
)

_said = False  # once per process: torch notes it once per process too


@contextmanager
def first_forward_without_torch_note() -> Iterator[None]:
    """Around a process's first training forward pass in which FTStrategy chose the search (the strategy asks once
    per fit, never on later steps): standard error captured and torch's note dropped from it, :data:`WHY` logged
    instead; once per process, as torch says it."""
    global _said
    if _said:
        yield
        return
    _said = True
    rank_zero_info(WHY)
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no standard error to capture
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = b"".join(line for line in capture.read().splitlines(keepends=True) if TORCH_NOTE not in line)
            if kept:
                os.write(2, kept)

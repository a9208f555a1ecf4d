"""A replica group's word that it reached the job's lighthouse: one small file per group, in the launcher's folder.

``lightning-ft launch`` starts whatever command it is given. A script whose Trainer has no FTStrategy (a plain
``strategy="ddp"``) never contacts the lighthouse: each group trains alone on the same data and exits 0, and nothing
would say so. So a group's rank 0 writes ``arrived.<run id>.group<G>.json`` into ``LIGHTNING_FT_RUN_END_DIR`` when
its fit has reached the lighthouse (:mod:`lightning_ft.start.lifecycle`), and the launcher warns once about each
group that has not, some time into the job or when it exits (:mod:`lightning_ft_cli.job_state`).

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_ft_job.run_end import configured_directory, write_json

_PREFIX = "arrived."


def _name(run_id: str, group: int) -> str:
    return f"{_PREFIX}{run_id.replace(os.sep, '_')}.group{group}.json"


def report_arrived(run_id: str, group: int) -> None:
    """Say that ``group`` of run ``run_id`` reached the lighthouse; a no-op without ``LIGHTNING_FT_RUN_END_DIR``
    (nobody started the group who would read it)."""
    directory = configured_directory()
    if directory is not None:
        write_json(directory / _name(run_id, group), {"run_id": run_id, "group": group})


def arrived_groups(directory: str | os.PathLike[str] | None, run_id: str, groups: tuple[int, ...]) -> set[int]:
    """Those of ``groups`` that said they reached the lighthouse in ``directory`` (none without a directory)."""
    if directory is None:
        return set()
    return {group for group in groups if (Path(directory) / _name(run_id, group)).exists()}

"""The launcher repeats a failed group's last lightning-ft error under its failure line: which lines count."""

from __future__ import annotations

import pytest

from lightning_ft_cli.launch import LIGHTNING_FT_ERROR


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        (
            "[rank0]: lightning_ft.heal.state.IncompatibleReplicaError: parameter 'w' differs",
            "IncompatibleReplicaError",
        ),
        ("lightning_ft.start.job_settings.JobContractError: lightning-ft: replica group 0 is", "JobContractError"),
        ("[rank1]: RuntimeError: lightning-ft: the lighthouse is gone", "RuntimeError"),
        ("RuntimeError: something of the user's code", None),
        ('  File "lightning_ft/strategy.py", line 3, in setup', None),
    ],
)
def test_the_launcher_keeps_the_last_line_of_a_lightning_ft_traceback_only(line, kept):
    match = LIGHTNING_FT_ERROR.match(line)
    assert (match is not None) == (kept is not None)
    if match is not None:
        assert kept in (match.group(1), match.group(3))

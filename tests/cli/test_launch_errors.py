"""The launcher repeats a failed group's first and last lightning-ft errors under its failure line: which lines
count, which two it keeps, and the line it prints."""

from __future__ import annotations

import io
import threading

import pytest

from lightning_ft_cli.launch import LIGHTNING_FT_ERROR, _relay_output, failure_summary


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


def test_a_failed_group_s_first_error_is_repeated_beside_its_last(capsys):
    """A restart's own error (no live peer left to heal from) must not hide the cause the group first printed."""
    output = b"".join(
        line + b"\n"
        for line in (
            b"lightning_ft.step.unfinished_reduction.UnusedParameterError: lightning-ft: a parameter got no gradient",
            b"RuntimeError: something of the user's code",
            b"lightning_ft.heal.state.IncompatibleReplicaError: lightning-ft: parameter 'w' differs",
            b"lightning_ft.start.job_settings.JobBehindCheckpointError: lightning-ft: behind step 11",
        )
    )
    errors: dict[int, list[str]] = {}
    _relay_output(1, io.BytesIO(output), threading.Lock(), errors)
    assert capsys.readouterr().out.count("[group 1] ") == 4  # every line relayed, prefixed
    assert errors == {
        1: [
            "UnusedParameterError: lightning-ft: a parameter got no gradient",
            "JobBehindCheckpointError: lightning-ft: behind step 11",
        ]
    }
    summary = failure_summary(1, 1, 2, errors[1])
    assert summary.endswith(
        "Its first error: UnusedParameterError: lightning-ft: a parameter got no gradient. "
        "Its last error: JobBehindCheckpointError: lightning-ft: behind step 11"
    ), summary
    assert "first error" not in failure_summary(1, 1, 2, errors[1][-1:])  # one error: said once
    assert "first error" not in failure_summary(1, 1, 2, [errors[1][0]] * 2)
    assert failure_summary(1, 1, 2, None).endswith("prefixed [group 1].")

"""``EventLogReader``: the harness's incremental view of a live event log gives what ``read_events`` gives, parsing
each line once, and never a line still being written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_ft_job.events import EventLogReader, read_events

pytestmark = pytest.mark.timeout(30)


def line(**record: object) -> str:
    return json.dumps(record) + "\n"


def test_only_appended_whole_lines_are_parsed_in_read_events_order(tmp_path: Path, monkeypatch):
    reader = EventLogReader(tmp_path)
    assert reader.records() == []
    group1 = tmp_path / "group1.rank0.jsonl"
    group1.write_text(line(event="started", n=1) + '{"event": "st')  # the second line is still being written
    assert reader.records() == [{"event": "started", "n": 1}]
    with group1.open("a") as file:
        file.write('ep", "n": 2}\n')
    group0 = tmp_path / "group0.rank0.jsonl"
    group0.write_text(line(event="started", n=0))
    assert (
        reader.records()
        == read_events(tmp_path)
        == [
            {"event": "started", "n": 0},
            {"event": "started", "n": 1},
            {"event": "step", "n": 2},
        ]
    )

    parsed: list[bytes] = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text: parsed.append(text) or real_loads(text))
    with group0.open("a") as file:
        file.write(line(event="step", n=3))
    assert reader.records()[1] == {"event": "step", "n": 3}
    assert parsed == [line(event="step", n=3).strip().encode()], "every earlier line was parsed again"


def test_a_line_cut_short_by_sigkill_and_the_restart_glued_to_it_is_skipped_as_read_events_skips_it(tmp_path):
    log = tmp_path / "group0.rank0.jsonl"
    log.write_text(line(event="started", attempt=0) + '{"event": "st')  # SIGKILL mid-line
    reader = EventLogReader(tmp_path)
    reader.records()
    with log.open("a") as file:  # the restarted process appends to the same file
        file.write(line(event="started", attempt=1) + line(event="step", attempt=1))
    assert (
        reader.records()
        == read_events(tmp_path)
        == [
            {"event": "started", "attempt": 0},
            {"event": "step", "attempt": 1},
        ]
    )

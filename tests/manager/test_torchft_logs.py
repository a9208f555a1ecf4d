"""torchft's handled failures are one terminal line each; the traceback goes to the event log
(``lightning_ft.manager.torchft_logs``). The multi-process neighbour, a real kill whose survivors' output holds no
traceback, is in ``tests/start/test_fault_schedules.py``."""

from __future__ import annotations

import io
import json
import logging

import pytest

from lightning_ft.manager.torchft_logs import TORCHFT_LOGGERS, quiet_torchft_logs
from lightning_ft_job import events


@pytest.fixture
def terminal():
    """What a terminal would show of torchft's loggers (a handler on each, as the root's would be)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in TORCHFT_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    quiet_torchft_logs()
    yield stream
    for logger in loggers:
        logger.removeHandler(handler)


def _handled_failure(logger: str, message: str) -> None:
    try:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\nGLHF!")
    except RuntimeError:
        logging.getLogger(logger).exception(message)


def test_a_handled_torchft_failure_is_one_line_and_its_traceback_goes_to_the_event_log(terminal, tmp_path, monkeypatch):
    monkeypatch.setenv(events.ENV_EVENTS_DIR, str(tmp_path))
    events.configure(replica_group_id=1, group_rank=0)
    try:
        _handled_failure("torchft.manager", "[lightning_ft_1/0 - step 41] got exception waiting for work boom")
        # The same failure seen again in the same step (torchft logs it from several places): nothing more shown.
        _handled_failure("torchft.manager", "[lightning_ft_1/0 - step 41] got exception in all reduce")
        _handled_failure("torchft.process_group", "got exception in worker: reset")
    finally:
        monkeypatch.delenv(events.ENV_EVENTS_DIR)
        events.configure(replica_group_id=1, group_rank=0)  # no directory: the event log closed
    shown = terminal.getvalue().splitlines()
    assert len(shown) == 2, shown
    assert shown[0].startswith("WARNING torchft.manager: [lightning_ft_1/0 - step 41] got exception waiting for work")
    assert "the event log" in shown[0] and shown[1].startswith("WARNING torchft.process_group: got exception in")
    assert "Traceback" not in terminal.getvalue() and "GLHF" not in terminal.getvalue()
    recorded = [json.loads(line) for path in tmp_path.rglob("*.jsonl") for line in path.read_text().splitlines()]
    errors = [record for record in recorded if record["event"] == "torchft_error"]
    assert len(errors) == 3
    assert all("Traceback (most recent call last)" in e["traceback"] and "GLHF!" in e["traceback"] for e in errors)


def test_torchft_at_debug_level_shows_the_whole_traceback(terminal):
    logger = logging.getLogger("torchft.manager")
    before = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        _handled_failure("torchft.manager", "[lightning_ft_0/0 - step 3] got exception waiting for work")
    finally:
        logger.setLevel(before)
    assert "Traceback (most recent call last)" in terminal.getvalue() and "GLHF!" in terminal.getvalue()


def test_other_torchft_records_pass_unchanged(terminal):
    logging.getLogger("torchft.manager").warning("a warning of torchft's own")
    assert terminal.getvalue() == "WARNING torchft.manager: a warning of torchft's own\n"

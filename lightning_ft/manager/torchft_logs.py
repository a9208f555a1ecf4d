"""torchft's Python logs as a training job's terminal shows them: one line for an error torchft expects and handles.

torchft logs every failure it handles with ``logger.exception``: a peer that dies mid-collective prints a full
traceback (``got exception waiting for work`` ... ``Connection reset by peer``) on every survivor, although the
Manager records the error, the step does not commit, and training goes on. That is the normal life of a
fault-tolerant job, and lightning-ft says it in one line of its own. So each such record becomes one line
(the first of its message, as a warning), at most one per Manager step, and its traceback goes to the event log
(``torchft_error``, :mod:`lightning_ft_job.events`). With torchft's loggers at ``DEBUG`` the record is left whole.
"""

from __future__ import annotations

import logging
import re
import traceback

from lightning_ft.torch_internals import nccl_flight_recorder_resettable
from lightning_ft_job import events

# torchft's modules that log handled failures with a traceback (``logging.getLogger(__name__)`` in each). A filter on
# a logger sees only the records made by that logger, so each one gets its own.
TORCHFT_LOGGERS = (
    "torchft.manager",
    "torchft.process_group",
    "torchft.checkpointing.http_transport",
    "torchft.checkpointing.pg_transport",
    "torchft.parameter_server",
    "torchft.local_sgd",
    "torchft.collectives",
    "torchft.futures",
)

# The longest terminal line kept of a record's first line.
_LINE_CHARS = 240
# torchft's Manager prefix: "[<replica id>/<group rank> - step <N>]".
_MANAGER_STEP = re.compile(r"^\[[^\]]* - step (\d+)\]")


class OneLineErrors(logging.Filter):
    """Turn a torchft record with a traceback into one terminal line; the traceback goes to the event log."""

    def __init__(self) -> None:
        super().__init__()
        self._steps_said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or record.levelno < logging.ERROR:
            return True
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True  # asked for: the whole record, traceback included
        message = record.getMessage()
        first_line = message.splitlines()[0] if message else ""
        events.emit(
            "torchft_error",
            logger=record.name,
            message=message,
            traceback="".join(traceback.format_exception(*record.exc_info)),
        )
        step = _MANAGER_STEP.match(first_line)
        if step is not None:
            if step.group(1) in self._steps_said:
                return False  # one line per step: the rest of the same failure is in the event log
            self._steps_said.add(step.group(1))
        if len(first_line) > _LINE_CHARS:
            first_line = first_line[: _LINE_CHARS - 3] + "..."
        where = "the event log" if events.current_directory() is not None else "DEBUG level on torchft's loggers"
        record.msg = f"{first_line} (torchft handles it; the traceback: {where})"
        record.args = None
        record.exc_info = None
        record.exc_text = None
        record.levelno = logging.WARNING
        record.levelname = logging.getLevelName(logging.WARNING)
        return True


_one_line_errors = OneLineErrors()


def _not_the_flight_recorder_warning(record: logging.LogRecord) -> bool:
    """torchft logs "Unable to reset NCCL flight recorder" at every reconfiguration of the process group on a torch
    build without NCCL's flight recorder (every CPU build), where there is nothing to reset."""
    return "Unable to reset NCCL flight recorder" not in record.getMessage()


def quiet_torchft_logs() -> None:
    """Make torchft's handled failures one line each (:class:`OneLineErrors`) and, without NCCL's flight recorder,
    drop torchft's warning that it cannot reset it (its Rust side's per-step INFO lines are off already:
    ``RUST_LOG``, set where ``lightning_ft`` is first imported). ``addFilter`` adds a filter once however often
    this runs."""
    for name in TORCHFT_LOGGERS:
        logging.getLogger(name).addFilter(_one_line_errors)
    if not nccl_flight_recorder_resettable():
        logging.getLogger("torchft.manager").addFilter(_not_the_flight_recorder_warning)

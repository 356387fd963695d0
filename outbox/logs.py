"""Structured logging for the daemons and the CLI: one line per event, JSON when asked.

Both formats stamp records in ISO-8601 UTC with milliseconds (``2026-11-23T07:01:49.123Z``)
so lines from hosts in different zones sort and correlate. In JSON mode every line on
stderr is one JSON object: ``extra=`` fields become keys, tracebacks a string field, and
Python warnings are routed through logging instead of being printed raw.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import threading
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


def utc_timestamp(record: logging.LogRecord) -> str:
    """``2026-11-23T07:01:49.123Z`` for the record's creation time."""
    when = dt.datetime.fromtimestamp(record.created, dt.UTC)
    return f"{when:%Y-%m-%dT%H:%M:%S}.{int(record.msecs):03d}Z"


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """What the caller passed as ``extra=``."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object, with ``extra=`` fields as keys."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": utc_timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        data.update(extra_fields(record))
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class KeyValueFormatter(logging.Formatter):
    """Human-readable line with ``extra=`` fields appended as key=value."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in extra_fields(record).items())
        return f"{line} {extras}" if extras else line


def setup_logging(level: str = "INFO", json_logs: bool = False) -> None:
    """One stderr handler on the root logger; ``level`` is a logging level name."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if json_logs
        else KeyValueFormatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # What Python would print raw to stderr (warnings, errors in __del__ or at shutdown, a
    # dying thread) goes through the same handler, so JSON mode stays one object per line.
    logging.captureWarnings(True)
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception


def _log_unraisable(args: sys.UnraisableHookArgs) -> None:
    logging.getLogger("python").warning(
        "exception ignored in %r",
        args.object,
        exc_info=args.exc_value,
    )


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    logging.getLogger("python").error(
        "uncaught exception in thread %s",
        args.thread.name if args.thread else "?",
        exc_info=args.exc_value,
    )

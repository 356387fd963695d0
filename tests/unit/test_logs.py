"""Log formats: one JSON object per line with extra fields as keys, ISO-8601 UTC
timestamps with milliseconds in both formats."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
import threading

import pytest

from outbox.logs import JsonFormatter, KeyValueFormatter, setup_logging
from outbox.settings import StatusSettings
from outbox.status_line import StatusLine

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("relay", logging.WARNING, __file__, 1, "dead-lettered", (), None)
    when = dt.datetime(2026, 11, 18, 8, 26, 40, 45_600, tzinfo=dt.UTC)
    record.created = when.timestamp()
    record.msecs = 45.6  # what logging computes for this time; shown truncated
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_line_is_one_object_with_extra_fields_and_utc_milliseconds() -> None:
    record = _record(event_id="e-1", topic="shop.orders", partition=3, lanes=[1, 2])
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["ts"] == "2026-11-18T08:26:40.045Z"
    assert data["level"] == "warning" and data["logger"] == "relay"
    assert data["msg"] == "dead-lettered"
    assert (data["event_id"], data["topic"], data["partition"]) == ("e-1", "shop.orders", 3)
    assert data["lanes"] == [1, 2]


def test_json_traceback_stays_on_the_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), None)
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc"]


def test_human_line_has_the_same_timestamp_and_key_values() -> None:
    formatter = KeyValueFormatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s")
    line = formatter.format(_record(event_id="e-1", partition=3))
    stamp, rest = line.split(" ", 1)
    assert TIMESTAMP.match(stamp) and stamp == "2026-11-18T08:26:40.045Z"
    assert rest == "WARNING relay: dead-lettered event_id=e-1 partition=3"


class _Breaks:
    def __del__(self) -> None:
        raise ValueError("in __del__")


def test_errors_python_would_print_raw_go_through_the_json_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    previous = (logging.getLogger().handlers[:], sys.unraisablehook, threading.excepthook)
    try:
        setup_logging("INFO", json_logs=True)

        def fail() -> None:
            raise RuntimeError("in a thread")

        worker = threading.Thread(target=fail, name="worker")
        worker.start()
        worker.join()
        _Breaks()  # dropped at once: its __del__ error is "ignored", i.e. printed raw
    finally:
        logging.getLogger().handlers[:], sys.unraisablehook, threading.excepthook = previous
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["msg"].split(" at 0x")[0] for line in lines] == [
        "uncaught exception in thread worker",
        "exception ignored in <function _Breaks.__del__",
    ]
    assert "RuntimeError: in a thread" in lines[0]["exc"]
    assert "ValueError: in __del__" in lines[1]["exc"]


def test_the_status_line_is_info_only_when_a_compared_figure_changed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.status")
    caplog.set_level(logging.DEBUG, logger="test.status")

    def levels(mode: str) -> list[str]:
        caplog.clear()
        line = StatusLine(
            log,
            "x status",
            StatusSettings(mode=mode),  # type: ignore[arg-type]
            start={"processed": 0, "age_seconds": 0.0},
            drifting=["age_seconds"],
            fields={"consumer": "x"},
        )
        for figures in (
            {"processed": 0, "age_seconds": 1.5},  # only a drifting figure moved
            {"processed": 2, "age_seconds": 2.5},
            {"processed": 2, "age_seconds": 3.5},
            {"processed": 2, "age_seconds": "unknown"},
        ):
            line.report(figures)
        assert all(r.getMessage() == "x status" and r.consumer == "x" for r in caplog.records)
        return [r.levelname for r in caplog.records]

    assert levels("changed") == ["DEBUG", "INFO", "DEBUG", "DEBUG"]
    assert levels("always") == ["INFO"] * 4

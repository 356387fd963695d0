"""Idle daemons are quiet: ``outbox relay`` and ``outbox consume`` (subprocesses, INFO logs,
``OUTBOX_STATUS__INTERVAL_SECONDS`` shortened to 0.5 s, the default ``changed`` mode) write
their status line while events flow and none over an idle window of 20 intervals — where
the old fixed line every interval would have written 20 each. Counts are integers."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.acceptance.conftest import (
    ROOT,
    Cli,
    Daemons,
    SchemaFactory,
    handled,
    numbered_app,
    relay_and_consumer,
)
from tests.support.relay import publish_numbered

pytestmark = pytest.mark.acceptance

INTERVAL = 0.5
IDLE_INTERVALS = 20
_LINE = {"relay": "relay status", "consumer": "consumer status"}


def _status_lines(daemons: Daemons, name: str) -> list[str]:
    text = daemons.logs[name].read_text(errors="replace")
    return [line for line in text.splitlines() if _LINE[name] in line]


def _wait(condition: object, within: float, daemons: Daemons) -> None:
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        assert daemons.alive(), daemons.dump()
        time.sleep(0.2)
    assert condition(), daemons.dump()  # type: ignore[operator]


def test_an_idle_relay_and_consumer_write_no_status_line_at_info(
    fresh_schema: SchemaFactory, acceptance_engine: Engine, tmp_path: Path
) -> None:
    settings = fresh_schema()
    suffix = uuid.uuid4().hex[:8]
    topic, group = f"idle-{suffix}", f"idle-{suffix}"
    app = numbered_app(tmp_path, group, topic)
    cli = Cli(
        settings,
        (
            ("PYTHONPATH", f"{tmp_path}:{ROOT}"),
            ("OUTBOX_LOG_LEVEL", "INFO"),
            ("OUTBOX_STATUS__INTERVAL_SECONDS", str(INTERVAL)),
        ),
    )
    with relay_and_consumer(cli, app, topic, 2, tmp_path) as daemons:
        # Events flow: both daemons say so (the consumer's first line is its first change).
        publish_numbered(acceptance_engine, settings, topic, 20, keys=4)
        _wait(lambda: handled(acceptance_engine, settings, group) == 20, 60, daemons)
        _wait(lambda: "processed=20" in "".join(_status_lines(daemons, "consumer")), 10, daemons)
        # The relay reads its pending count every relay.stats_interval_seconds (5 s).
        _wait(lambda: " pending=0 " in "".join(_status_lines(daemons, "relay")[-1:]), 20, daemons)
        before = {name: _status_lines(daemons, name) for name in _LINE}
        time.sleep(IDLE_INTERVALS * INTERVAL)
        after = {name: _status_lines(daemons, name) for name in _LINE}
        assert daemons.alive(), daemons.dump()
    assert after == before, daemons.dump()
    relay_last = before["relay"][-1]
    assert re.search(r" INFO .* published=20 moved_to_failed=0 kafka_up=1 ", relay_last), relay_last
    assert " pending=0 " in relay_last and " outbox_dead_tuples=" in relay_last, relay_last
    consumer_last = before["consumer"][-1]
    assert re.search(r" INFO .* processed=20 duplicates=0 ", consumer_last), consumer_last

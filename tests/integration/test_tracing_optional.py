"""Without the ``otel`` extra nothing changes and nothing is imported: publish, the relay
and the consumer daemon run with every ``opentelemetry`` import refused, deliver the
events, and end with no OpenTelemetry module loaded."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.inbox import wait_for
from tests.support.wrapped import Wrapped

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    return isolated_settings


async def test_without_the_extra_the_whole_path_runs_and_imports_no_opentelemetry(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(1)
    run = Wrapped("tests.support.no_otel", settings, topic, tmp_path, ".json")
    ids = set(json.loads(run.publish("3")))
    tables = build_tables(settings)
    with engine.connect() as conn:
        headers = (
            conn.execute(select(tables.events.c.headers).where(tables.events.c.topic == topic))
            .scalars()
            .all()
        )
    assert headers == [{}, {}, {}]  # no trace context added

    def handled() -> bool:
        inbox = tables.inbox
        with engine.connect() as conn:
            done = conn.execute(
                select(inbox.c.event_id).where(
                    inbox.c.consumer == run.group, inbox.c.status == "processed"
                )
            )
            return ids <= set(done.scalars())

    async with run.daemons():
        await wait_for(handled, timeout=90, what="the consumer to handle the events")
    for name in ("producer", "relay", "consumer"):
        report = json.loads(run.out[name].read_text())
        assert report["imported"] == [], (name, report)
        # The one guarded import in outbox/tracing.py tried, and nothing else did.
        assert set(report["attempted"]) == {"opentelemetry"}, (name, report)

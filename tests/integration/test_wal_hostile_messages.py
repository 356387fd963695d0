"""No crash loop on one event (issue 51): an event written into the WAL without ``publish``
(a raw ``pg_logical_emit_message``, which ``publish``'s NUL check never saw) with a NUL in
its type, its source and a header value, and too large for its topic: Kafka refuses it, it
lands in the failed table with that text escaped, the events after it are delivered, and
the relay keeps running: 0 exits over 3 starts.

Before, the failed table's INSERT failed (PostgreSQL's text and jsonb refuse NUL) and the
relay exited 1 on every start, the slot pinned before the event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox import Message, Outbox, wal_codec
from outbox.envelope import prepare
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.kafka import create_topic
from tests.support.relay import RelayProcess, read_ids
from tests.support.wal import wait_until, wal_relay_env

pytestmark = pytest.mark.integration


def _emit_raw(settings: OutboxSettings, topic: str) -> str:
    """A message as a producer bypassing ``publish`` could write it; its event id."""
    row = prepare(
        Message(topic=topic, key="a", event_type="t", payload=b"x" * 5000),
        lanes=settings.lanes,
        max_bytes=settings.max_payload_bytes,
        default_source="svc",
    )
    row = dataclasses.replace(
        row, event_type="t\x00ype", source="s\x00rc", headers=json.dumps({"h": "v\x00"})
    )
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::bytea)",
            (settings.wal.prefix, wal_codec.encode([row])),
        )
    return str(row.event_id)


def _failed(engine: Engine, settings: OutboxSettings) -> list[tuple[str, str, str, str, str]]:
    failed = build_tables(settings).failed.fullname
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                f"SELECT event_id::text, event_type, source, headers::text, last_error"
                f" FROM {failed}"
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


async def test_a_nul_event_kafka_refuses_lands_in_failed_and_the_relay_keeps_running(
    engine: Engine, wal_settings: OutboxSettings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    settings = wal_settings
    topic = await create_topic(kafka_bootstrap, None, 1, {"max.message.bytes": "2000"})
    hostile = _emit_raw(settings, topic)
    ob = Outbox(settings)
    with engine.begin() as conn:
        after = ob.publish(conn, topic=topic, key="a", event_type="t", payload={"n": 1})
    env = wal_relay_env(settings, OUTBOX_RELAY__MAX_ATTEMPTS="1")
    codes = []
    for start in range(3):
        relay = RelayProcess(env, tmp_path, f"r{start}")
        try:
            if start == 0:
                await read_ids(kafka_bootstrap, topic, [str(after)])
                found = await asyncio.to_thread(
                    wait_until, lambda: len(_failed(engine, settings)) == 1, 60
                )
                assert found, relay.log()[-3000:]
            else:
                await asyncio.sleep(3)  # a crash loop would have exited by now
            assert relay.alive(), relay.log()[-3000:]
            code, _ = relay.terminate()
            codes.append(code)
        finally:
            relay.kill()
        assert "Traceback" not in relay.log()
    assert codes == [0, 0, 0]
    [(event_id, event_type, source, headers, error)] = _failed(engine, settings)
    assert event_id == hostile
    assert (event_type, source) == ("t\\x00ype", "s\\x00rc")
    assert json.loads(headers) == {"h": "v\\x00"}
    assert "Kafka rejected" in error and "escaped" in error, error
    # The next event goes through as ever.
    with engine.begin() as conn:
        later = ob.publish(conn, topic=topic, key="a", event_type="t", payload={"n": 2})
    relay = RelayProcess(env, tmp_path, "r3")
    try:
        t0 = time.monotonic()
        await read_ids(kafka_bootstrap, topic, [str(later)])
        assert time.monotonic() - t0 < 60
    finally:
        relay.kill()

"""No crash loop on one event (issue 51): an event written into the WAL without ``publish``
(a raw ``pg_logical_emit_message``, which ``publish``'s NUL check never saw) with a NUL in
its type, its source and a header value, and too large for its topic: Kafka refuses it, it
lands in the failed table with that text escaped, the events after it are delivered, and
the relay keeps running: 0 exits over 3 starts. A message under the prefix that does not
decode is quarantined there (its bytes kept, its LSN named) and the events behind it flow;
only one of a newer encoding version stops the relay (exit 2, "upgrade the relay").

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
from relay.event import QUARANTINE_TOPIC, QUARANTINE_TYPE
from tests.support.kafka import create_topic
from tests.support.relay import RelayProcess, outbox_cli, read_ids
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


def _emit(settings: OutboxSettings, content: bytes) -> None:
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::bytea)", (settings.wal.prefix, content)
        )


def _quarantined(engine: Engine, settings: OutboxSettings) -> list[tuple[str, bytes, str]]:
    failed = build_tables(settings).failed.fullname
    with engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT topic, payload, last_error FROM {failed} WHERE event_type = :t"),
            {"t": QUARANTINE_TYPE},
        ).all()
    return [(r[0], bytes(r[1]), r[2]) for r in rows]


async def test_an_undecodable_message_is_quarantined_and_the_events_behind_it_flow(
    engine: Engine, wal_settings: OutboxSettings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    settings = wal_settings
    topic = await create_topic(kafka_bootstrap, None, 2)
    ob = Outbox(settings)
    first = prepare(
        Message(topic=topic, key="a", event_type="t", payload={"n": 0}),
        lanes=settings.lanes,
        max_bytes=settings.max_payload_bytes,
        default_source="svc",
    )
    # One event, then a truncated one: the first is published, the message quarantined.
    garbled = wal_codec.encode([first]) + b"\x00\x00\x00\x40short"
    _emit(settings, garbled)
    _emit(settings, bytes([wal_codec.VERSION]) + b"five!")  # garbage under the prefix
    with engine.begin() as conn:
        behind = ob.publish_many(
            conn, [Message(topic=topic, key=f"k{n}", event_type="t", payload={}) for n in range(20)]
        )
    env = wal_relay_env(settings)
    relay = RelayProcess(env, tmp_path, "wal")
    try:
        await read_ids(kafka_bootstrap, topic, [str(first.event_id), *map(str, behind)])
        found = await asyncio.to_thread(
            wait_until, lambda: len(_quarantined(engine, settings)) == 2, 30
        )
        assert found, relay.log()[-3000:]
        kept = _quarantined(engine, settings)
        assert {payload for _, payload, _ in kept} == {
            garbled,
            bytes([wal_codec.VERSION]) + b"five!",
        }
        for topic_, _, error in kept:
            assert topic_ == QUARANTINE_TOPIC
            assert "undecodable WAL message at LSN " in error and "outbox failed retry" in error
        assert relay.log().count("undecodable WAL message quarantined") == 2
        # Retried in WAL mode: emitted again as they were, quarantined again (new LSNs).
        retried = await asyncio.to_thread(outbox_cli, "failed", "retry", "--all", env=env)
        assert retried.returncode == 0 and "requeued 2" in retried.stdout, retried
        again = await asyncio.to_thread(
            wait_until, lambda: relay.log().count("undecodable WAL message quarantined") == 4, 30
        )
        assert again, relay.log()[-3000:]
        assert {p for _, p, _ in _quarantined(engine, settings)} == {p for _, p, _ in kept}
        assert relay.alive(), relay.log()[-3000:]
        code, _ = relay.terminate()
    finally:
        relay.kill()
    assert code == 0
    assert "Traceback" not in relay.log()


async def test_a_message_of_an_unknown_encoding_version_stops_the_relay_with_exit_2(
    wal_settings: OutboxSettings, tmp_path: Path
) -> None:
    _emit(wal_settings, bytes([wal_codec.VERSION + 1]) + b"from a newer producer")
    relay = RelayProcess(wal_relay_env(wal_settings), tmp_path, "wal")
    try:
        code = await asyncio.to_thread(relay.proc.wait, 60)
    finally:
        relay.kill()
    log = relay.log()
    assert code == 2, log[-3000:]
    assert "upgrade the relay" in log and "Traceback" not in log

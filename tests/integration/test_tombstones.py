"""Tombstones end to end (real PostgreSQL and Kafka): a key's create, update and delete go
through the outbox and the relay to a compacted topic and through the inbox to handlers, in
order; the delete is a record with a null value and no content type on the wire. A handler
that cannot take a tombstone dead-letters it (value still null), and a replay re-sends it."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, func, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import DeadLetterFilter, DeadLetters, EventContext
from outbox import TOMBSTONE, Outbox
from outbox.ops.topics import TopicSpec, ensure
from outbox.settings import OutboxSettings
from relay import Relay, list_failed, retry_failed
from relay.event import CE_ID
from relay.sources.table.cursor import LANE_START
from relay.sources.table.store import ClaimStore
from tests.support.inbox import RunningConsumer, fast_settings, wait_for
from tests.support.kafka import Record, cleanup_policies, read_all, read_until
from tests.support.relay import outbox_cli, relay_env

pytestmark = pytest.mark.integration


class Customer(BaseModel):
    id: str
    name: str


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    # A relay publishes every pending row of its tables: this test gets tables of its own.
    return isolated_settings


def _publish(engine: Engine, ob: Outbox, topic: str, key: str, kind: str, payload: object) -> str:
    with Session(engine) as session, session.begin():
        event_id = ob.publish(
            session,
            topic=topic,
            key=key,
            event_type=f"customer.{kind}",
            payload=payload,  # type: ignore[arg-type]
        )
    return str(event_id)


async def test_create_update_and_tombstone_reach_a_compacted_topic_and_the_inbox_in_order(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str
) -> None:
    suffix = uuid.uuid4().hex[:8]
    topic = f"customers-{suffix}"
    [created] = await ensure(settings, [TopicSpec(topic, 3, compact=True)])
    assert (created.status, created.compact) == ("created", True)
    assert await cleanup_policies(kafka_bootstrap, [topic]) == {topic: "compact"}

    # One key's life, each step its own transaction; another key in between.
    ob = Outbox(settings)
    ids = [
        _publish(engine, ob, topic, "c-1", "upserted", Customer(id="c-1", name="Ada")),
        _publish(engine, ob, topic, "c-2", "upserted", Customer(id="c-2", name="Grace")),
        _publish(engine, ob, topic, "c-1", "upserted", Customer(id="c-1", name="Ada L.")),
        _publish(engine, ob, topic, "c-1", "deleted", TOMBSTONE),
    ]
    relay = Relay(
        settings.model_copy(
            update={"relay": settings.relay.model_copy(update={"heartbeat_seconds": 0.3})}
        )
    )
    task = asyncio.create_task(relay.run())
    try:
        records = await read_all(kafka_bootstrap, topic, expect=4, wait_seconds=60)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 15)
    assert sorted(r.headers["ce_id"].decode() for r in records) == sorted(ids)
    life = [r for r in records if r.key == b"c-1"]
    assert [r.headers["ce_id"].decode() for r in life] == [ids[0], ids[2], ids[3]]
    assert (
        len({r.partition for r in life}) == 1 and life[0].offset < life[1].offset < life[2].offset
    )
    tombstone = life[-1]
    assert tombstone.value is None  # a null value on the wire, not b"" and not b"null"
    assert tombstone.headers["ce_type"] == b"customer.deleted"
    assert {"ce_id", "ce_source", "ce_time", "ce_specversion"} <= set(tombstone.headers)
    assert "content-type" not in tombstone.headers
    assert life[0].headers["content-type"] == b"application/json"

    # The inbox: the state table follows the key's life; a deletion removes the row.
    table = f"customers_{suffix}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id text PRIMARY KEY, name text NOT NULL)"))
    app = inbox.Consumer(name=f"crm-{suffix}", topics=[topic])
    seen: list[tuple[str, str | None]] = []

    @app.handler("customer.upserted")
    async def upsert(customer: Customer, session: AsyncSession) -> None:
        seen.append((customer.id, customer.name))
        await session.execute(
            text(
                f"INSERT INTO {table} (id, name) VALUES (:id, :name)"
                " ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name"
            ),
            {"id": customer.id, "name": customer.name},
        )

    @app.handler("customer.deleted")
    async def delete(customer: Customer | None, session: AsyncSession, ctx: EventContext) -> None:
        assert customer is None and ctx.key is not None
        seen.append((ctx.key.decode(), None))
        await session.execute(text(f"DELETE FROM {table} WHERE id = :id"), {"id": ctx.key.decode()})

    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 4, what="the four events")
    assert [s for s in seen if s[0] == "c-1"] == [("c-1", "Ada"), ("c-1", "Ada L."), ("c-1", None)]
    assert c.metrics.counts["dead_lettered"] == 0
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT id, name FROM {table}")).all() == [("c-2", "Grace")]

    # A consumer whose handler takes the model alone: the tombstone is dead-lettered at once
    # (null value kept), the partition moves on, and a replay sends the null value again.
    strict = inbox.Consumer(name=f"strict-{suffix}", topics=[topic])
    strict.handler("customer.upserted")(upsert)

    @strict.handler("customer.deleted")
    async def cannot(customer: Customer, session: AsyncSession) -> None:
        raise AssertionError("a tombstone never reaches a handler that cannot take None")

    async with RunningConsumer(strict, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 1, what="the dead letter")
        await wait_for(lambda: c.metrics.counts["processed"] >= 3, what="the others")
    assert c.metrics.counts["retries"] == 0
    [dead] = await read_all(kafka_bootstrap, f"{topic}.dlq", expect=1)
    assert dead.value is None and dead.key == b"c-1"
    assert dead.headers["dlq_error_class"] == b"TombstoneRefused"
    assert b"Customer | None" in dead.headers["dlq_error_message"]
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                f"SELECT value IS NULL, key FROM {settings.db_schema}."
                f"{settings.table_prefix}dead_letters WHERE consumer = :c"
            ),
            {"c": strict.name},
        ).one()
    assert tuple(stored) == (True, b"c-1")

    env = relay_env(settings)
    shown = outbox_cli("dlq", "show", ids[3], "--consumer", strict.name, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "value: null (a tombstone)" in shown.stdout

    letters = DeadLetters(settings)
    try:
        report = await letters.replay(DeadLetterFilter(consumer=strict.name, event_id=ids[3]))
    finally:
        await letters.close()
    assert [x.event_id for x in report.replayed] == [ids[3]]

    def replayed(record: Record) -> bool:
        return "dlq_replay" in record.headers

    again = [r for r in await read_until(kafka_bootstrap, topic, replayed) if replayed(r)]
    assert len(again) == 1 and again[0].value is None and again[0].key == b"c-1"
    assert again[0].headers["ce_id"].decode() == ids[3]


async def test_a_tombstone_put_back_or_parked_by_the_relay_keeps_its_null_payload(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str
) -> None:
    """The relay's restore (Kafka did not take the row) and move-to-failed statements, and
    the operator's failed list/retry, carry a NULL payload and content type through."""
    topic = f"customers-{uuid.uuid4().hex[:8]}"  # does not exist yet
    ob = Outbox(settings)
    event_id = _publish(engine, ob, topic, "c-9", "deleted", TOMBSTONE)
    events = ob.tables.events
    relay = Relay(settings)
    task = asyncio.create_task(relay.run())
    try:
        # A missing topic: the relay claims the row, cannot send it, and puts it back.
        def put_back() -> bool:
            with engine.connect() as conn:
                row = conn.execute(
                    events.select().where(events.c.event_id == uuid.UUID(event_id))
                ).one()
            return row.last_error is not None

        await wait_for(put_back, what="the relay to put the row back")
    finally:
        relay.stop()
        await asyncio.wait_for(task, 15)
    with engine.connect() as conn:
        row = conn.execute(events.select().where(events.c.event_id == uuid.UUID(event_id))).one()
    assert (row.payload, row.content_type, row.key) == (None, None, b"c-9")
    assert "does not exist" in row.last_error

    # Parked as failed (what a permanent rejection does), listed, retried: still a tombstone.
    with engine.begin() as conn:  # due now (the relay put it back with a re-check delay)
        conn.execute(events.update().values(available_at=func.now()))
    store = ClaimStore.of(settings)
    with psycopg.connect(settings.libpq_dsn) as conn:
        conn.execute(store.fence, {"lanes": list(range(settings.lanes))})
        claimed = conn.execute(
            store.claim,
            {
                "lanes": list(range(settings.lanes)),
                "after": [LANE_START] * settings.lanes,
                "limit": 10,
                "max_bytes": 1 << 20,
            },
        ).fetchall()
        assert [r[CE_ID] for r in claimed] == [event_id]
        params = store.restore_params(claimed, [5], ["rejected"], [0.0])
        conn.execute(store.move_to_failed, params)
    [failed], total = list_failed(settings, topic=topic)
    assert (total, failed.event_id, failed.payload_bytes) == (1, event_id, None)
    wide = relay_env(settings, COLUMNS="250")  # `failed list` fits its table to the width
    shown = outbox_cli("failed", "list", "--topic", topic, env=wide)
    assert shown.returncode == 0 and "tombstone" in shown.stdout, shown.stdout
    assert retry_failed(settings, [failed.id]) == [failed.id]
    with engine.connect() as conn:
        row = conn.execute(events.select().where(events.c.event_id == uuid.UUID(event_id))).one()
    assert (row.payload, row.content_type) == (None, None)

    # Once the topic exists, the relay sends it: a null value on the wire.
    await ensure(settings, [TopicSpec(topic, 1, compact=True)])
    task = asyncio.create_task((relay := Relay(settings)).run())
    try:
        [record] = await read_all(kafka_bootstrap, topic, expect=1, wait_seconds=60)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 15)
    assert record.value is None and record.headers["ce_id"].decode() == event_id

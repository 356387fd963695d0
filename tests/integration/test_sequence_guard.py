"""The stale-event guard (``@app.handler(..., stale="skip")``) against real PostgreSQL and
Kafka: an event whose sequence is not above the one applied for its key is skipped."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox import DeadLetterFilter, DeadLetters, Permanent
from outbox import Message, Outbox
from outbox.envelope import SEQUENCE_HEADER
from outbox.settings import OutboxSettings
from tests.support.inbox import (
    RunningConsumer,
    ce_headers,
    effect_rows,
    effects_table,
    fast_settings,
    produce,
    wait_for,
)

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]


class Version(BaseModel):
    key: str
    seq: int
    fail: bool = False


def versioned(key: str, seq: int | None, event_id: str | None = None, **body: object):
    extra = {} if seq is None else {SEQUENCE_HEADER: f"{seq:020d}"}
    headers = ce_headers(event_id or str(uuid.uuid4()), "thing.updated", **extra)
    value = json.dumps({"key": key, "seq": seq if seq is not None else -1, **body}).encode()
    return key.encode(), value, headers


@dataclass
class Guarded:
    app: inbox.Consumer
    table: str
    topic: str


@pytest.fixture
async def guarded(engine: Engine, new_topic: NewTopic) -> Guarded:
    """A consumer of a fresh topic whose handler is guarded against stale events and
    records what it applied in a fresh table."""
    table = effects_table(engine)
    app = inbox.Consumer(name=f"seq-{uuid.uuid4().hex[:10]}", topics=[await new_topic()])

    @app.handler("thing.updated", stale="skip")
    async def apply(event: Version, session: AsyncSession) -> None:
        if event.fail:
            raise Permanent("rejected")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": f"{event.key}:{event.seq}", "k": event.key, "s": event.seq},
        )

    return Guarded(app, table, app.topics[0])


async def test_older_sequences_are_skipped_newer_ones_applied(
    settings: OutboxSettings, engine: Engine, guarded: Guarded, kafka_bootstrap: str
) -> None:
    app, table, topic = guarded.app, guarded.table, guarded.topic
    records = [
        versioned("a", 2),
        versioned("a", 1),  # older than 2: stale
        versioned("b", 1),  # another key has its own sequence
        versioned("a", 2),  # equal (another event id): stale
        versioned("a", 3),
        versioned("a", None),  # no sequence: no guard, handled
    ]
    await produce(kafka_bootstrap, topic, records)
    async with RunningConsumer(app, fast_settings(settings, max_attempts=2)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] == 6, what="all six committed")
    assert c.metrics.counts["stale"] == 2
    assert [(k, s) for _, k, s in effect_rows(engine, table)] == [
        ("a", 2),
        ("b", 1),
        ("a", 3),
        ("a", -1),
    ]


async def test_a_dead_letter_replayed_after_a_newer_version_is_skipped(
    settings: OutboxSettings, engine: Engine, guarded: Guarded, kafka_bootstrap: str
) -> None:
    app, table, topic = guarded.app, guarded.table, guarded.topic
    old, current = str(uuid.uuid4()), str(uuid.uuid4())
    letters = DeadLetters(settings)
    try:
        async with RunningConsumer(app, fast_settings(settings, max_attempts=2)) as c:
            # Version 5 of "x" fails and is dead-lettered; version 6 of "x" is applied;
            # version 1 of "y" fails too, and nothing newer of "y" arrives.
            await produce(
                kafka_bootstrap,
                topic,
                [
                    versioned("x", 5, old, fail=True),
                    versioned("x", 6),
                    versioned("y", 1, current, fail=True),
                ],
            )
            await wait_for(lambda: c.metrics.counts["dead_lettered"] == 2, what="dead letters")
            await wait_for(lambda: c.metrics.counts["processed"] == 1, what="version 6")
            # Replaying dead letters re-sends the original records; the guard decides.
            # The rejected flag is in the payload, so replay records that now pass:
            await _fix_payloads(engine, settings, app.name)
            report = await letters.replay(DeadLetterFilter(consumer=app.name))
            assert len(report.replayed) == 2
            await wait_for(lambda: c.metrics.counts["processed"] == 3, what="both replays")
        assert c.metrics.counts["stale"] == 1  # x:5 came after x:6
    finally:
        await letters.close()
    assert [(k, s) for _, k, s in effect_rows(engine, table)] == [("x", 6), ("y", 1)]


async def _fix_payloads(engine: Engine, settings: OutboxSettings, consumer: str) -> None:
    """The operator's fix before a replay: the stored records no longer ask to fail."""
    dead_letters = f"{settings.db_schema}.{settings.table_prefix}dead_letters"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE {dead_letters} SET value = convert_to(replace(convert_from(value, "
                "'UTF8'), '\"fail\": true', '\"fail\": false'), 'UTF8') WHERE consumer = :c"
            ),
            {"c": consumer},
        )


async def test_an_unreadable_sequence_is_dead_lettered_at_once(
    settings: OutboxSettings, engine: Engine, guarded: Guarded, kafka_bootstrap: str
) -> None:
    app, table, topic = guarded.app, guarded.table, guarded.topic
    key, value, headers = versioned("z", 1)
    headers = [(n, b"v2" if n == SEQUENCE_HEADER else v) for n, v in headers]
    await produce(kafka_bootstrap, topic, [(key, value, headers), versioned("z", 2)])
    async with RunningConsumer(app, fast_settings(settings, max_attempts=2)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] == 1, what="the valid one")
        await wait_for(lambda: c.metrics.counts["dead_lettered"] == 1, what="the invalid one")
    assert c.metrics.counts["retries"] == 0
    assert [(k, s) for _, k, s in effect_rows(engine, table)] == [("z", 2)]


def test_publish_writes_the_sequence_as_a_cloudevents_extension(
    settings: OutboxSettings, engine: Engine
) -> None:
    ob = Outbox(settings)
    topic = f"seq-{uuid.uuid4().hex[:8]}"
    with engine.connect() as conn:  # rolled back at exit: the row never reaches a relay
        [event_id] = ob.publish_many(
            conn,
            [Message(topic=topic, key="order-1", event_type="e", payload={}, sequence=42)],
        )
        stored = conn.execute(
            text(f"SELECT headers FROM {ob.tables.events.fullname} WHERE event_id = :e"),
            {"e": event_id},
        ).scalar_one()
    headers = stored if isinstance(stored, dict) else json.loads(stored)
    assert headers[SEQUENCE_HEADER] == "00000000000000000042"

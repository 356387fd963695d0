"""The consumer's hot path against real PostgreSQL and Kafka: connections kept open between
transactions, the fetch linger, handlers that use the ORM or no session at all."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import BigInteger, Engine, Text, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import inbox
from inbox.store import InboxStore
from outbox.settings import ConsumerSettings, OutboxSettings
from tests.support.inbox import (
    RunningConsumer,
    ce_headers,
    effect_counts,
    effects_table,
    produce,
    wait_for,
)

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]


def records(first: int, n: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [
        (b"k", json.dumps({"seq": i}).encode(), ce_headers(f"e-{uuid.uuid4()}"))
        for i in range(first, first + n)
    ]


def effects_model(table: str) -> type:
    class Base(DeclarativeBase):
        pass

    class Effect(Base):
        __tablename__ = table
        id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
        event_id: Mapped[str] = mapped_column(Text)

    return Effect


async def test_a_hot_connection_killed_between_transactions_is_replaced_and_charges_nothing(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    Effect = effects_model(table)
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        session.add(Effect(event_id=event.event_id))  # the ORM: flushed at commit

    failed: list[int] = []  # the connections a claim failed on
    claim = InboxStore.begin_and_claim

    async def spy(self: InboxStore, conn: Any, *args: Any, **kw: Any) -> set[str]:
        try:
            return await claim(self, conn, *args, **kw)
        except Exception:
            failed.append(id(conn))
            raise

    monkeypatch.setattr(InboxStore, "begin_and_claim", spy)
    async with RunningConsumer(app, settings) as c:
        await wait_for(c.assigned, what="assignment")
        await produce(kafka_bootstrap, topic, records(0, 20))
        await wait_for(lambda: c.metrics.counts["processed"] >= 20, what="first batch")
        held = list(c.daemon._connections._free)
        assert held, "the hot path keeps its connections between transactions"
        pids = [h.raw.info.backend_pid for h in held]
        with engine.connect() as conn:  # the database drops them (a restart, a proxy)
            for pid in pids:
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        for wave in range(1, 4):
            await produce(kafka_bootstrap, topic, records(20 * wave, 20))
            done = 20 * (wave + 1)
            await wait_for(lambda done=done: c.metrics.counts["processed"] >= done, what="wave")
    counts = effect_counts(engine, table)
    assert len(counts) == 80 and set(counts.values()) == {1}
    # Infrastructure trouble: no handler attempt was charged, nothing dead-lettered.
    assert c.metrics.counts["retries"] == 0 and c.metrics.counts["dead_lettered"] == 0
    # A connection that failed was closed for good, never handed out again.
    assert len(failed) == len(set(failed)) <= len(pids)


async def test_a_handler_that_never_touches_the_session_is_still_deduped(
    settings: OutboxSettings, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=1)
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])
    seen: list[str] = []

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        seen.append(event.event_id)  # no database work of its own

    batch = records(0, 5)
    async with RunningConsumer(app, settings) as c:
        await wait_for(c.assigned, what="assignment")
        await produce(kafka_bootstrap, topic, batch)
        await wait_for(lambda: c.metrics.counts["processed"] >= 5, what="first copies")
        await produce(kafka_bootstrap, topic, batch)  # redelivered: duplicates now
        await wait_for(lambda: c.metrics.counts["duplicates"] >= 5, what="second copies")
    # Each delivery committed in transactions of its own (the metric operators tune by).
    assert 2 <= c.metrics.counts["transactions"] <= 10
    assert sorted(seen) == sorted(
        h[1].decode() for _, _, hs in batch for h in hs if h[0] == "ce_id"
    )


async def test_fetches_linger_while_records_flow_and_not_when_quiet(
    settings: OutboxSettings, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=2)
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])
    during: list[tuple[int, int]] = []
    lingering = settings.model_copy(update={"consumer": ConsumerSettings(linger_ms=7)})
    c = RunningConsumer(app, lingering)

    def fetch_settings() -> tuple[int, int]:
        assert c.daemon._kafka is not None
        found = c.daemon._kafka.fetch_wait()
        assert found is not None
        return found

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        during.append(fetch_settings())

    async with c:
        await wait_for(c.assigned, what="assignment")
        quiet = fetch_settings()
        await produce(kafka_bootstrap, topic, records(0, 10))
        await wait_for(lambda: c.metrics.counts["processed"] >= 10, what="records")
        # A fetch timeout without records: the next record is fetched at once again.
        await wait_for(lambda: fetch_settings() == quiet, what="quiet settings again")
    assert quiet == (1, 500)  # aiokafka's defaults: the app did not tune fetching
    assert during and all(s[1] == 7 and s[0] > 1 for s in during)


async def test_the_app_tuning_fetches_itself_turns_the_linger_off(
    settings: OutboxSettings, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=1)
    app = inbox.Consumer(
        name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic], kafka_options={"fetch_max_wait_ms": 50}
    )
    waits: list[int] = []
    c = RunningConsumer(app, settings)

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        assert c.daemon._kafka is not None
        found = c.daemon._kafka.fetch_wait()
        assert found is not None
        waits.append(found[1])

    async with c:
        await wait_for(c.assigned, what="assignment")
        await produce(kafka_bootstrap, topic, records(0, 3))
        await wait_for(lambda: c.metrics.counts["processed"] >= 3, what="records")
        await asyncio.sleep(0)
    assert waits and set(waits) == {50}

"""What a consumer adds to ``consumer_stats`` for the console's charts (inbox/stats.py),
read back as the console reads it (outbox/ops/consumers.py): events processed, handler
time, dead letters, retries — and nothing while nothing happens."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from outbox.db import async_engine
from outbox.ops.consumers import activity
from outbox.settings import OutboxSettings
from tests.support.inbox import RunningConsumer, ce_headers, fast_settings, produce, wait_for
from tests.support.kafka import create_topic
from tests.support.services import Endpoints
from tests.support.tables import own_tables

pytestmark = pytest.mark.integration


class Item(BaseModel):
    n: int


async def test_a_consumer_adds_its_minutes_and_nothing_while_idle(
    base_settings: OutboxSettings, services: Endpoints
) -> None:
    settings = fast_settings(own_tables(base_settings, "s"), stats_seconds=0.2, max_attempts=2)
    topic = await create_topic(services.kafka_bootstrap, None, 1)
    app = inbox.Consumer(name=f"stats-{uuid.uuid4().hex[:6]}", topics=[topic])

    @app.handler("item")
    async def handle(event: Item, session: AsyncSession) -> None:
        await asyncio.sleep(0.01)
        if event.n == 0:
            raise RuntimeError("item 0 fails")

    records = [
        (b"k", Item(n=n).model_dump_json().encode(), ce_headers(str(uuid.uuid4()), "item"))
        for n in range(6)
    ]
    engine = async_engine(settings)
    try:

        async def minutes() -> list[tuple[int, float, int, int]]:
            found = (await activity(engine, settings)).minutes.get(app.name, [])
            return [(m.processed, m.handler_seconds, m.dead_lettered, m.retries) for m in found]

        async def totals() -> tuple[int, float, int, int]:
            rows = await minutes()
            return (
                sum(r[0] for r in rows),
                sum(r[1] for r in rows),
                sum(r[2] for r in rows),
                sum(r[3] for r in rows),
            )

        async with RunningConsumer(app, settings) as c:
            await produce(services.kafka_bootstrap, topic, records)
            await wait_for(lambda: c.metrics.counts["dead_lettered"] == 1, what="a dead letter")

            async def written() -> bool:
                return (await totals())[0] == 5

            await wait_for(written, what="the figures written")
            processed, seconds, dead, retries = await totals()
            assert (processed, dead, retries) == (5, 1, 1)
            assert 0.07 <= seconds < 5  # 7 handler runs of 10 ms at least
            before = await minutes()
            await asyncio.sleep(1.0)  # idle: five write periods without a change
            assert await minutes() == before
        # As the console reads them (the last minute may be cut by a minute's end).
        views = (await activity(engine, settings)).minutes[app.name]
        assert all(v.ms_per_event is None or v.ms_per_event >= 10 for v in views)
        assert any(v.per_second > 0 for v in views)
    finally:
        await engine.dispose()

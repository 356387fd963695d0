"""Counts per day for operators' overviews (the console): failed outbox rows. Dead letters
per day are the inbox's (``DeadLetters.by_day``)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import translated_errors
from outbox.ops.store import OpsStore
from outbox.settings import OutboxSettings
from outbox.tables import build_tables


async def failed_by_day(
    engine: AsyncEngine, settings: OutboxSettings, days: int = 14
) -> list[tuple[dt.date, int]]:
    """Outbox rows Kafka rejected for good, per day, over the last ``days`` days."""
    store = OpsStore(build_tables(settings))
    with translated_errors():
        async with engine.connect() as conn:
            rows = (await conn.execute(store.failed_by_day, {"days": days})).all()
    return [(day.date(), int(n)) for day, n in rows]

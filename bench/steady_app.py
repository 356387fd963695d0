"""The consumer of ``bench.steady``: notes when each event's handler ran, nothing else.

Run by the benchmark as ``outbox consume bench.steady_app:app`` (the CLI daemon, as users
run it). The topic comes from ``BENCH_STEADY_TOPIC``: this is a benchmark fixture, not
library code, so it may read its own variable.
"""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox

TABLE = "bench_steady_seen"
# clock_timestamp(), not now(): now() is the transaction's start, and a transaction may
# carry events fetched over several milliseconds.
DDL = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (event_id text PRIMARY KEY, "
    "handled_at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
_NOTE = text(f"INSERT INTO {TABLE} (event_id) VALUES (:e)")

app = inbox.Consumer(name="bench-steady", topics=[os.environ.get("BENCH_STEADY_TOPIC", "unset")])


@app.handler("bench.steady")
async def note(event: inbox.InboxEvent, session: AsyncSession) -> None:
    await session.execute(_NOTE, {"e": event.event_id})

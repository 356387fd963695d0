"""The consumer of ``bench.steady``: notes when each event's handler ran, nothing else.

Two apps, one per handler shape (``--handler``): ``app`` runs a per-event handler (one
INSERT each: a round trip per event), ``batch_app`` a batch handler (one multi-row INSERT
per list of events: what a projection into a table does).

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
_NOTE_ALL = text(f"INSERT INTO {TABLE} (event_id) SELECT unnest(CAST(:ids AS text[]))")
_TOPICS = [os.environ.get("BENCH_STEADY_TOPIC", "unset")]

app = inbox.Consumer(name="bench-steady", topics=_TOPICS)
batch_app = inbox.Consumer(name="bench-steady", topics=_TOPICS)


@app.handler("bench.steady")
async def note(event: inbox.InboxEvent, session: AsyncSession) -> None:
    await session.execute(_NOTE, {"e": event.event_id})


@batch_app.handler("bench.steady", batch=True)
async def note_all(events: list[inbox.InboxEvent], session: AsyncSession) -> None:
    await session.execute(_NOTE_ALL, {"ids": [e.event_id for e in events]})

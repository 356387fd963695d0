"""A consumer app for records of any shape, run by the property tests as
`outbox consume tests.support.hostile_apps:app`: ``test.event`` goes to a per-event
handler, ``test.batch`` to a batch handler; both write (event id, offset) into the effects
table and nothing else (the records' bytes are the test's subject, not the handlers').
Configured by INBOX_TEST_* environment variables (the library never reads them)."""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox

NAME = os.environ.get("INBOX_TEST_CONSUMER", "unconfigured")
TOPIC = os.environ.get("INBOX_TEST_TOPIC", "unconfigured")
EFFECTS = os.environ.get("INBOX_TEST_EFFECTS", "unconfigured")

app = inbox.Consumer(name=NAME, topics=[TOPIC])

INSERT = text(
    f"INSERT INTO {EFFECTS} (event_id, seq) "
    "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:offsets AS int[]))"
)


@app.handler("test.event", max_attempts=1)
async def one(event: inbox.InboxEvent, session: AsyncSession) -> None:
    await session.execute(INSERT, {"ids": [event.event_id], "offsets": [event.offset]})


@app.handler("test.batch", batch=True, max_attempts=1)
async def many(events: list[inbox.InboxEvent], session: AsyncSession) -> None:
    await session.execute(
        INSERT, {"ids": [e.event_id for e in events], "offsets": [e.offset for e in events]}
    )

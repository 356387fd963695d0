"""Test helpers for producing code: what a unit of work published to the outbox.

::

    with Session(engine) as session, session.begin():
        service.place(session, customer="c1")
        [event] = published(session, settings, topic="orders")
        assert event.event_type == "order.created" and event.json()["customer"] == "c1"

It reads the outbox table through the caller's session, so it sees the events of the
transaction still open (nothing has to commit) and of earlier, committed ones that no
relay published yet. With the pytest plugin (``outbox_published`` fixture) the settings
are bound already.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from outbox.envelope import SEQUENCE_HEADER
from outbox.producer import AsyncExecutor, SyncExecutor
from outbox.settings import OutboxSettings
from outbox.store import ProducerStore
from outbox.tables import build_tables


@dataclass(frozen=True)
class PublishedEvent:
    """One outbox row, decoded."""

    event_id: uuid.UUID
    topic: str
    key: str | None
    event_type: str
    source: str
    payload: bytes | None  # None: a tombstone (``payload=outbox.TOMBSTONE``)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def is_tombstone(self) -> bool:
        return self.payload is None

    def json(self) -> Any:
        """The payload parsed as JSON (None for a tombstone)."""
        return None if self.payload is None else json.loads(self.payload)

    @property
    def sequence(self) -> int | None:
        text = self.headers.get(SEQUENCE_HEADER)
        return None if text is None else int(text)


def _decode(row: Any) -> PublishedEvent:
    event_id, topic, key, event_type, source, payload, headers = row
    if isinstance(headers, str):
        headers = json.loads(headers)
    return PublishedEvent(
        event_id=event_id,
        topic=topic,
        key=None if key is None else bytes(key).decode("utf-8", errors="replace"),
        event_type=event_type,
        source=source,
        payload=None if payload is None else bytes(payload),
        headers=dict(headers or {}),
    )


def published(
    session: SyncExecutor, settings: OutboxSettings, topic: str | None = None
) -> list[PublishedEvent]:
    """Events in the outbox not yet published (of ``topic``, if given), oldest first."""
    store = ProducerStore(build_tables(settings))
    return [_decode(row) for row in session.execute(store.unpublished(topic))]


async def published_async(
    session: AsyncExecutor, settings: OutboxSettings, topic: str | None = None
) -> list[PublishedEvent]:
    """:func:`published` for ``AsyncSession`` / ``AsyncConnection``."""
    store = ProducerStore(build_tables(settings))
    return [_decode(row) for row in await session.execute(store.unpublished(topic))]

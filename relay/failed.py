"""Operator functions over the failed table: list, retry (back into the outbox), purge.

Retried rows get new ids, in the order of their old ones, so they join the head of their lane like
new rows (the relays' claim cursors may be past their old ids: relay/sources/table/cursor.py). Their
order relative to later events of the same key was given up when Kafka rejected them.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from outbox import wal_codec
from outbox.db import unavailable
from outbox.envelope import Row
from outbox.settings import OutboxSettings
from outbox.sources import source_of
from relay.event import CE_ID, QUARANTINE_CONTENT_TYPE, TOPIC, Event
from relay.metrics import RelayMetrics
from relay.outage import missing_table
from relay.sources.wal.store import WalStore
from relay.store import RelayStore

log = logging.getLogger("relay")


@dataclass(frozen=True)
class FailedRow:
    id: int
    event_id: str
    topic: str
    event_type: str
    attempts: int
    last_error: str | None
    failed_at: dt.datetime
    payload_bytes: int | None  # None: a tombstone


def report_moved(dead: Sequence[tuple[Event, int, str]], metrics: RelayMetrics) -> None:
    """Log and count events just moved to the failed table (by either source): one ERROR
    line each, with what Kafka said."""
    for row, attempts, err in dead:
        log.error(
            "event moved to failed after %d attempts",
            attempts,
            extra={"event_id": row[CE_ID], "topic": row[TOPIC], "error": err},
        )
    metrics.failed.inc(len(dead))


@contextmanager
def _connection(settings: OutboxSettings) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    try:
        conn = psycopg.connect(settings.libpq_dsn, application_name="outbox-failed")
    except psycopg.Error as exc:
        raise unavailable(exc) from None
    try:
        with conn, conn.transaction():
            yield conn
    except psycopg.errors.UndefinedTable as exc:
        raise missing_table(exc) from None


def list_failed(
    settings: OutboxSettings, *, topic: str | None = None, limit: int = 100
) -> tuple[list[FailedRow], int]:
    """Up to ``limit`` failed rows (oldest id first) and the total count."""
    store = RelayStore.of(settings)
    with _connection(settings) as conn:
        rows = conn.execute(store.failed_list, {"topic": topic, "limit": limit}).fetchall()
        total = conn.execute(store.failed_count).fetchone()
    return [FailedRow(*r) for r in rows], int(total[0]) if total else 0  # type: ignore[arg-type,call-overload]


def retry_failed(settings: OutboxSettings, ids: Sequence[int] | None) -> list[int]:
    """Move failed rows (``None`` = all) back to the outbox with attempts reset; for a
    source that reads a slot, back into the WAL as messages. Put back into the table
    beside WAL relays only (a shell left on the table source), they are published by the
    relay reading the slot (relay/sources/wal/table_rows.py)."""
    chosen = list(ids) if ids is not None else None
    if source_of(settings).reads_slot:
        return _retry_into_wal(settings, chosen)
    store = RelayStore.of(settings)
    with _connection(settings) as conn:
        rows = conn.execute(store.failed_retry, {"ids": chosen})
        return sorted(int(r[0]) for r in rows.fetchall())  # type: ignore[call-overload]


def _retry_into_wal(settings: OutboxSettings, ids: list[int] | None) -> list[int]:
    store = WalStore.of(settings)
    with _connection(settings) as conn:
        taken = conn.execute(store.failed_take, {"ids": ids}).fetchall()
        if not taken:
            return []
        contents = []
        for _, event_id, topic, key, event_type, source, content_type, payload, headers in taken:
            if content_type == QUARANTINE_CONTENT_TYPE:  # an undecodable message: as it was
                contents.append(bytes(payload))  # type: ignore[call-overload]
                continue
            row = Row(
                event_id=uuid.UUID(str(event_id)),
                topic=str(topic),
                key=None if key is None else bytes(key),  # type: ignore[call-overload]
                lane=0,
                event_type=str(event_type),
                source=str(source),
                content_type=None if content_type is None else str(content_type),
                payload=None if payload is None else bytes(payload),  # type: ignore[call-overload]
                headers=str(headers),
                fingerprint=b"",
                delay_seconds=0.0,
            )
            contents.append(wal_codec.encode([row]))
        conn.execute(store.emit, {"prefix": settings.wal.prefix, "contents": contents})
    return sorted(int(r[0]) for r in taken)  # type: ignore[call-overload]


def purge_failed(
    settings: OutboxSettings, ids: Sequence[int] | None, older_than_hours: float | None = None
) -> list[int]:
    """Delete failed rows by id, or older than ``older_than_hours``, or all (both None)."""
    store = RelayStore.of(settings)
    with _connection(settings) as conn:
        rows = conn.execute(
            store.failed_purge,
            {"ids": list(ids) if ids is not None else None, "hours": older_than_hours},
        )
        return sorted(int(r[0]) for r in rows.fetchall())  # type: ignore[call-overload]

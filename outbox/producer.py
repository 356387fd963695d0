"""Publishing events inside the caller's transaction.

``publish`` never commits, never opens a connection and never talks to Kafka: it adds one
INSERT to the transaction the caller already has open, so the event exists if and only if
the caller's domain writes commit. The relay publishes it later.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Unpack

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import envelope, tracing, wal_codec
from outbox.db import translated_errors
from outbox.envelope import Message, MessageFields, Row
from outbox.errors import PayloadMismatch, UnsupportedInWalMode, WalSlotMissing
from outbox.settings import OutboxSettings
from outbox.sources import source_of
from outbox.store import ProducerStore, WalProducerStore
from outbox.tables import build_tables

SyncExecutor = Session | Connection
AsyncExecutor = AsyncSession | AsyncConnection
# WAL mode: events of one call share a message up to this many content bytes (always at
# least one event per message). Fewer, larger messages cost the producer and the decoder
# less per event; the cap keeps what the relay holds of one message small.
WAL_MESSAGE_BYTES = 256 * 1024


class Outbox:
    """The producer front: ``publish`` / ``publish_many``, sync and async.

    >>> ob = Outbox(OutboxSettings())
    >>> with Session(engine) as session, session.begin():       # doctest: +SKIP
    ...     session.add(Order(id=42, total=990))
    ...     ob.publish(session, topic="orders", key="42", event_type="order.created",
    ...                payload={"order_id": 42, "total": 990})
    """

    def __init__(self, settings: OutboxSettings) -> None:
        self.settings = settings
        self.tables = build_tables(settings)
        self._store = ProducerStore(self.tables)
        wal = source_of(settings).reads_slot
        self._wal = WalProducerStore(settings.wal.prefix, settings.wal.slot) if wal else None

    # -- preparation and checks shared by both paths (no I/O) --------------------------
    def _prepare(self, messages: Iterable[Message]) -> list[Row]:
        s = self.settings
        # The current trace context rides along as headers (a no-op unless tracing is on).
        messages = tracing.with_trace_context(messages)
        return [
            envelope.prepare(
                m, lanes=s.lanes, max_bytes=s.max_payload_bytes, default_source=s.default_source
            )
            for m in messages
        ]

    def _wal_contents(self, rows: Sequence[Row]) -> list[bytes]:
        """WAL mode: the rows as message contents, in order (see ``WAL_MESSAGE_BYTES``)."""
        if any(r.delay_seconds for r in rows):
            raise UnsupportedInWalMode("delay_seconds")
        contents: list[bytes] = []
        group: list[Row] = []
        size = 0
        for row in rows:
            n = len(row.payload or b"") + len(row.key or b"") + len(row.headers) + 64
            if group and size + n > WAL_MESSAGE_BYTES:
                contents.append(wal_codec.encode(group))
                group, size = [], 0
            group.append(row)
            size += n
        contents.append(wal_codec.encode(group))
        return contents

    def _emitted(self, first: object, rows: Sequence[Row]) -> list[uuid.UUID]:
        """WAL mode: the event ids, or :class:`WalSlotMissing` when the emit returned no
        row (the slot gate in ``WalProducerStore``: nothing was emitted)."""
        if first is None:
            raise WalSlotMissing(self.settings.wal.slot)
        return [r.event_id for r in rows]

    @staticmethod
    def _not_inserted(rows: Sequence[Row], inserted: Iterable[uuid.UUID]) -> list[uuid.UUID]:
        done = set(inserted)
        return [r.event_id for r in rows if r.event_id not in done]

    @staticmethod
    def _differing(rows: Sequence[Row], stored: Iterable[Any]) -> list[Row]:
        # A duplicate event_id is a no-op only when it describes the same event; the same
        # id inside one batch with two payloads is caught here too. Equal fingerprints
        # settle it; a differing one may still be the same JSON in another encoding.
        stored_by_id = {event_id: fingerprint for event_id, fingerprint in stored}
        return [
            row
            for row in rows
            if stored_by_id.get(row.event_id, row.fingerprint) != row.fingerprint
        ]

    @staticmethod
    def _check_same(rows: Sequence[Row], stored: Iterable[Any]) -> None:
        stored_by_id = {
            r.event_id: envelope.StoredEvent(
                r.topic,
                r.key,
                r.event_type,
                r.content_type,
                None if r.payload is None else bytes(r.payload),
            )
            for r in stored
        }
        for row in rows:
            found = stored_by_id.get(row.event_id)
            # A row gone since the first look (relayed and moved) can no longer be compared.
            if found is None or not envelope.same_event(row, found):
                raise PayloadMismatch(row.event_id)

    # -- sync ---------------------------------------------------------------------------
    def publish_many(self, session: SyncExecutor, messages: Iterable[Message]) -> list[uuid.UUID]:
        """Add all ``messages`` to the caller's transaction in one statement.

        Returns their event ids in order. Duplicates of events still in the outbox are
        no-ops (a JSON payload counts as the same when its RFC 8785 canonical form is, so
        member order does not matter); a reused event_id with a different topic, key, type
        or payload raises :class:`PayloadMismatch`.

        With ``source = "wal"`` the events become logical-decoding messages in the same
        transaction instead (docs/howto/wal-source.md): a re-published id is published
        again (the inbox dedupes it; no :class:`PayloadMismatch` check, there is no row to
        compare with), ``delay_seconds`` raises :class:`UnsupportedInWalMode`, and so that no
        event commits that no slot will read, :class:`WalSlotMissing` is raised (nothing
        written) while ``wal.slot`` does not exist or is lost.
        """
        rows = self._prepare(messages)
        if not rows:
            return []
        if self._wal is not None:
            emit = self._wal.emit(self._wal_contents(rows))
            with translated_errors():
                emitted = session.execute(*emit).first()
            return self._emitted(emitted, rows)
        with translated_errors():
            result = session.execute(*self._store.insert(rows))
            missing = self._not_inserted(rows, result.scalars())
            if missing or len({r.event_id for r in rows}) != len(rows):
                stored = session.execute(self._store.fingerprints([r.event_id for r in rows]))
                if differing := self._differing(rows, stored):
                    ids = [r.event_id for r in differing]
                    self._check_same(differing, session.execute(self._store.stored_events(ids)))
        return [r.event_id for r in rows]

    def publish(self, session: SyncExecutor, **fields: Unpack[MessageFields]) -> uuid.UUID:
        """Add one event to the caller's open transaction; returns its event id.

        Keyword arguments are the fields of :class:`~outbox.envelope.Message`: ``topic``,
        ``payload``, ``event_type`` (required), ``key``, ``event_id``, ``headers``,
        ``source``, ``delay_seconds``, ``sequence``. ``payload=outbox.TOMBSTONE`` publishes
        a null value for ``key`` (deletes it from a compacted topic).
        """
        return self.publish_many(session, [Message(**fields)])[0]

    # -- async --------------------------------------------------------------------------
    async def publish_many_async(
        self, session: AsyncExecutor, messages: Iterable[Message]
    ) -> list[uuid.UUID]:
        """Async :meth:`publish_many` for ``AsyncSession`` / ``AsyncConnection``."""
        rows = self._prepare(messages)
        if not rows:
            return []
        if self._wal is not None:
            emit = self._wal.emit(self._wal_contents(rows))
            with translated_errors():
                emitted = (await session.execute(*emit)).first()
            return self._emitted(emitted, rows)
        with translated_errors():
            result = await session.execute(*self._store.insert(rows))
            missing = self._not_inserted(rows, result.scalars())
            if missing or len({r.event_id for r in rows}) != len(rows):
                stored = await session.execute(self._store.fingerprints([r.event_id for r in rows]))
                if differing := self._differing(rows, stored):
                    ids = [r.event_id for r in differing]
                    found = await session.execute(self._store.stored_events(ids))
                    self._check_same(differing, found)
        return [r.event_id for r in rows]

    async def publish_async(
        self, session: AsyncExecutor, **fields: Unpack[MessageFields]
    ) -> uuid.UUID:
        """Async :meth:`publish`."""
        return (await self.publish_many_async(session, [Message(**fields)]))[0]

"""The producer side's SQL, in one place (and the three catalog queries of the session
probe in ``outbox/poolers.py``). Nothing else in ``outbox`` builds statements.

Inserts go through ``unnest`` so that one statement carries any number of rows with a
fixed number of bind parameters (a multi-row VALUES list would hit PostgreSQL's 65,535
parameter limit at a few thousand rows). ``WITH ORDINALITY ... ORDER BY`` keeps the
identity values in the caller's order, which is the publish order inside a lane.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import (
    Float,
    Insert,
    LargeBinary,
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID, insert

from outbox.envelope import Row
from outbox.tables import Tables

_UNNEST_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("event_id", UUID(as_uuid=True)),
    ("topic", Text()),
    ("key", LargeBinary()),
    ("lane", SmallInteger()),
    ("event_type", Text()),
    ("source", Text()),
    ("content_type", Text()),
    ("payload", LargeBinary()),
    ("headers", Text()),
    ("fingerprint", LargeBinary()),
    ("delay_seconds", Float()),
)


@dataclass(frozen=True)
class ProducerStore:
    tables: Tables

    @cached_property
    def insert_rows(self) -> Insert:
        """INSERT ... SELECT FROM unnest(arrays) ON CONFLICT (event_id) DO NOTHING."""
        events = self.tables.events
        src = (
            func.unnest(*(bindparam(name, type_=ARRAY(t)) for name, t in _UNNEST_COLUMNS))
            .table_valued(*(column(name) for name, _ in _UNNEST_COLUMNS), with_ordinality="ord")
            .render_derived(name="m")
        )
        rows = select(
            src.c.event_id,
            src.c.topic,
            src.c.key,
            src.c.lane,
            src.c.event_type,
            src.c.source,
            src.c.content_type,
            src.c.payload,
            cast(src.c.headers, JSONB),
            src.c.fingerprint,
            func.now() + src.c.delay_seconds * literal_column("interval '1 second'"),
        ).order_by(src.c.ord)
        return (
            insert(events)
            .from_select(
                [
                    "event_id",
                    "topic",
                    "key",
                    "lane",
                    "event_type",
                    "source",
                    "content_type",
                    "payload",
                    "headers",
                    "fingerprint",
                    "available_at",
                ],
                rows,
            )
            .on_conflict_do_nothing(index_elements=["event_id"])
            .returning(events.c.event_id)
        )

    @cached_property
    def insert_row(self) -> Insert:
        """The same insert for exactly one row, with scalar parameters: for a single event,
        dumping eleven one-element arrays cost more CPU than the rest of ``publish``."""
        events = self.tables.events
        p = {name: bindparam(name, type_=t) for name, t in _UNNEST_COLUMNS}
        return (
            insert(events)
            .values(
                event_id=p["event_id"],
                topic=p["topic"],
                key=p["key"],
                lane=p["lane"],
                event_type=p["event_type"],
                source=p["source"],
                content_type=p["content_type"],
                payload=p["payload"],
                headers=cast(p["headers"], JSONB),
                fingerprint=p["fingerprint"],
                available_at=func.now()
                + p["delay_seconds"] * literal_column("interval '1 second'"),
            )
            .on_conflict_do_nothing(index_elements=["event_id"])
            .returning(events.c.event_id)
        )

    def unpublished(self, topic: str | None) -> Select[tuple[Any, ...]]:
        """Events not published yet, in publish order (what ``outbox.testing`` reads)."""
        e = self.tables.events
        stmt = select(
            e.c.event_id, e.c.topic, e.c.key, e.c.event_type, e.c.source, e.c.payload, e.c.headers
        ).where(e.c.published_at.is_(None))
        if topic is not None:
            stmt = stmt.where(e.c.topic == topic)
        return stmt.order_by(e.c.id)

    def insert(self, rows: Sequence[Row]) -> tuple[Insert, dict[str, Any]]:
        """The statement and parameters that insert ``rows`` (one statement for any number)."""
        if len(rows) == 1:
            return self.insert_row, {name: getattr(rows[0], name) for name, _ in _UNNEST_COLUMNS}
        return self.insert_rows, {
            name: [getattr(r, name) for r in rows] for name, _ in _UNNEST_COLUMNS
        }

    def fingerprints(self, event_ids: Sequence[uuid.UUID]) -> Select[tuple[uuid.UUID, bytes]]:
        """Stored fingerprints of already-present events (to detect a reused event_id)."""
        events = self.tables.events
        return select(events.c.event_id, events.c.fingerprint).where(
            events.c.event_id.in_(event_ids)
        )

    def stored_events(self, event_ids: Sequence[uuid.UUID]) -> Select[Any]:
        """What identifies stored events (see :class:`~outbox.envelope.StoredEvent`), for
        the ids whose fingerprint differed from the one being published."""
        e = self.tables.events
        return select(
            e.c.event_id, e.c.topic, e.c.key, e.c.event_type, e.c.content_type, e.c.payload
        ).where(e.c.event_id.in_(event_ids))


# The slot the relay reads, as a filter on the emit: a logical slot decodes only WAL written
# after its creation, so a message emitted while it does not exist (before `outbox wal
# setup`, after a drop) or is lost is never read. Uncorrelated, so PostgreSQL evaluates it
# once, before any message (a one-time filter): with no usable slot the statement returns
# no row and emits nothing, in the same round trip. invalidation_reason (PostgreSQL 17+)
# is read through to_jsonb, NULL before 17.
_SLOT_USABLE = text(
    "EXISTS (SELECT FROM pg_replication_slots s WHERE s.slot_name = :slot"
    " AND s.database = current_database() AND s.slot_type = 'logical'"
    " AND s.wal_status IS DISTINCT FROM 'lost'"
    " AND to_jsonb(s) ->> 'invalidation_reason' IS NULL)"
)


@dataclass(frozen=True)
class WalProducerStore:
    """The producer's SQL in WAL mode (``source = "wal"``): transactional logical-decoding
    messages under the configured prefix, written in the caller's transaction and decoded
    (in commit order) only if it commits.

    With ``slot`` the messages are emitted only while that slot exists and is usable (the
    statement then returns a row per message, otherwise none: the caller raises). ``slot``
    None emits unchecked (the producer benchmark's baseline)."""

    prefix: str
    slot: str | None = None

    def _gated(self, stmt: Select[Any]) -> Select[Any]:
        return stmt if self.slot is None else stmt.where(_SLOT_USABLE)

    @cached_property
    def emit_one(self) -> Select[Any]:
        return self._gated(
            select(
                func.pg_logical_emit_message(
                    literal(True), literal(self.prefix), bindparam("content", type_=LargeBinary())
                )
            )
        )

    @cached_property
    def emit_many(self) -> Select[Any]:
        contents = (
            func.unnest(bindparam("contents", type_=ARRAY(LargeBinary())))
            .table_valued(column("c"), with_ordinality="ord")
            .render_derived(name="m")
        )
        # One statement for any number of messages, emitted in the given order.
        return self._gated(
            select(
                func.pg_logical_emit_message(literal(True), literal(self.prefix), contents.c.c)
            ).order_by(contents.c.ord)
        )

    def emit(self, contents: Sequence[bytes]) -> tuple[Select[Any], dict[str, Any]]:
        params: dict[str, Any] = {} if self.slot is None else {"slot": self.slot}
        if len(contents) == 1:
            return self.emit_one, {"content": contents[0], **params}
        return self.emit_many, {"contents": list(contents), **params}


# -- the session probe (outbox/poolers.py): raw psycopg, catalog only --------------------------
# Params: ns, key (int4). Each returns the backend pid first.
PROBE_LOCK = "SELECT pg_backend_pid(), pg_try_advisory_lock(%(ns)s::int4, %(key)s::int4)"
PROBE_HOLDERS = (
    "SELECT pg_backend_pid(), coalesce(array_agg(l.pid), '{}') FROM pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
    " AND l.classid::int8 = %(ns)s AND l.objid::int8 = %(key)s"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
PROBE_UNLOCK = "SELECT pg_backend_pid(), pg_advisory_unlock(%(ns)s::int4, %(key)s::int4)"

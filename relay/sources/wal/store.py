"""The WAL source's SQL, in one place; the modules of relay/sources/wal/ run it.

The slot itself is streamed over the replication protocol (relay/sources/wal/stream.py: its one
command, ``START_REPLICATION``, is built there); everything else — the reader lock, the
heartbeat, the outbox-table check when switching, the failed table — is plain SQL here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property

from psycopg import sql

from outbox.settings import OutboxSettings
from outbox.wake import namespace_base


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL writes it (``16/B374D848``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass(frozen=True)
class WalStore:
    schema: str
    prefix: str
    slot: str

    @classmethod
    def of(cls, settings: OutboxSettings) -> WalStore:
        return cls(settings.db_schema, settings.table_prefix, settings.wal.slot)

    @cached_property
    def reader_lock(self) -> tuple[int, int]:
        """The session advisory lock only the relay reading the slot holds: (namespace,
        key). Its own namespace beside the table source's three, keyed by the slot name."""
        base = namespace_base(self.schema, self.prefix)
        return base | 0x40000000, zlib.crc32(self.slot.encode()) & 0x7FFFFFFF

    @cached_property
    def try_lock(self) -> sql.Composed:
        ns, key = self.reader_lock
        return sql.SQL("SELECT pg_try_advisory_lock({}, {})").format(
            sql.Literal(ns), sql.Literal(key)
        )

    # Params: prefix. A transactional message in a transaction of its own: its commit is a
    # position the relay may confirm, so an idle slot keeps moving (a non-transactional one
    # has no commit and would not).
    heartbeat = "SELECT pg_logical_emit_message(true, %(prefix)s, ''::bytea)"

    # The outbox table's rows that go before WAL transactions (relay/sources/wal/gate.py):
    # unpublished, and not delayed at publish (never tried, due later than created): a
    # delayed event holds back no later event, not even of its key (docs/howto/publish.md).
    _HOLDING = (
        "published_at IS NULL"
        " AND NOT (attempts = 0 AND last_error IS NULL AND available_at > created_at)"
    )

    @cached_property
    def table_oldest(self) -> sql.Composed:
        """When the oldest row of the outbox table that goes first was created (NULL: none),
        and when this was asked (relay/sources/wal/gate.py: switching between the sources)."""
        events = sql.Identifier(self.schema, f"{self.prefix}events")
        return sql.SQL("SELECT min(created_at), statement_timestamp() FROM {} WHERE {}").format(
            events, sql.SQL(self._HOLDING)
        )

    @cached_property
    def table_holding(self) -> sql.Composed:
        """Those rows per topic, most first (params: until: created before it)."""
        events = sql.Identifier(self.schema, f"{self.prefix}events")
        return sql.SQL(
            "SELECT topic, count(*) FROM {} WHERE {} AND created_at <= %(until)s"
            " GROUP BY topic ORDER BY count(*) DESC, topic"
        ).format(events, sql.SQL(self._HOLDING))

    @cached_property
    def new_ids(self) -> sql.Composed:
        """``n`` fresh ids from the outbox's identity (a failed row needs one: param n)."""
        # Quoted: pg_get_serial_sequence parses the name (schema and prefix are validated).
        events = f'"{self.schema}"."{self.prefix}events"'
        return sql.SQL(
            "SELECT nextval(pg_get_serial_sequence({}, 'id')) FROM generate_series(1, %(n)s)"
        ).format(sql.Literal(events))

    @cached_property
    def failed_take(self) -> sql.Composed:
        """Remove failed rows (all when %(ids)s is NULL) to publish them again as WAL
        messages (``outbox failed retry`` in WAL mode), oldest id first; returns what a
        message needs. Their emission goes in the same transaction."""
        failed = sql.Identifier(self.schema, f"{self.prefix}failed")
        return sql.SQL(
            "WITH moved AS (DELETE FROM {failed}"
            " WHERE %(ids)s::int8[] IS NULL OR id = ANY(%(ids)s::int8[]) RETURNING *)"
            " SELECT id, event_id, topic, key, event_type, source, content_type, payload,"
            " headers::text FROM moved ORDER BY id"
        ).format(failed=failed)

    # Params: prefix, contents (bytea[]): one message each, in order.
    emit = (
        "SELECT pg_logical_emit_message(true, %(prefix)s, c)"
        " FROM unnest(%(contents)s::bytea[]) WITH ORDINALITY AS m(c, ord) ORDER BY ord"
    )

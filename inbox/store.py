"""The inbox's SQL, in one place. Nothing else in ``inbox`` builds statements.

Every method takes the caller's session or connection so that the inbox row, the
handler's writes and the attempt marker share the caller's transaction.

The statements of the hot path (the claim, the attempt marker, the sequence guard) talk to
psycopg directly, as the relay does: at a few events per transaction, SQLAlchemy Core's
execute path (compiled-cache lookup, execution context, result wrapping, the greenlet
hop) cost more CPU than the round trip itself. They are composed once with
``psycopg.sql`` (schema and table prefix quoted as identifiers, values always bound) and
take a psycopg connection, or a SQLAlchemy session or connection whose driver connection
is then used (same connection, same transaction). They never ask for server-side prepared
statements themselves: whether psycopg prepares them is the connection's
``prepare_threshold``, set where connections are made (``outbox/db.py``), so a pooler that
cannot keep them (PgBouncer in transaction mode) is handled in one place. The operator
statements (dead letters, replay) stay on SQLAlchemy Core: they are rare.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from sqlalchemy import Table, and_, delete, func, or_, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from inbox.event import InboxEvent
from outbox.errors import OutboxError
from outbox.ops.deadletters import DeadLetter, DeadLetterFilter, DeadLetterGroup
from outbox.tables import Tables

Executor = AsyncSession | AsyncConnection
# A psycopg connection of the hot path (autocommit mode: see begin_and_claim).
Driver = psycopg.AsyncConnection[Any]
Db = Executor | Driver
# (topic, partition, start offset, end offset): arm one partition's attempt marker.
Arm = tuple[str, int, int, int]

PROCESSED = "processed"
DEAD_LETTERED = "dead_lettered"
REPLAYING = "replaying"


@dataclass(frozen=True)
class Marker:
    """The durable attempt marker of one partition (see ``tables._inbox_attempts``)."""

    start_offset: int
    end_offset: int
    attempts: int
    last_error: str | None


_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"


def _name(table: Table) -> sql.Identifier:
    return sql.Identifier(table.schema, table.name) if table.schema else sql.Identifier(table.name)


async def _driver(db: Db) -> Driver:
    """The psycopg connection under ``db`` (a session's is its current transaction's)."""
    if isinstance(db, psycopg.AsyncConnection):
        return db
    conn = await db.connection() if isinstance(db, AsyncSession) else db
    driver = (await conn.get_raw_connection()).driver_connection
    assert isinstance(driver, psycopg.AsyncConnection)
    return driver


@dataclass(frozen=True)
class _Statements:
    """The hot path's statements, composed once per store."""

    claim: bytes
    claim_arm: bytes  # the claim, and (a data-modifying CTE) arming markers
    arm: bytes
    get_marker: bytes
    set_marker: bytes
    finish_marker: bytes
    disarm_marker: bytes
    advance_sequence: bytes
    advance_sequences: bytes

    @classmethod
    def of(cls, tables: Tables) -> _Statements:
        inbox, attempts = _name(tables.inbox), _name(tables.inbox_attempts)
        # The events travel as one JSON array of [id, topic, partition, offset, type]
        # rows: the statement text (and a server plan prepared for it) is the same for any
        # number of events, and json.dumps (C) costs a fifth of the client CPU of five
        # arrays adapted by psycopg (~0.7 against ~3 µs per event, plus ~10 µs per array).
        # A row left `replaying` by `outbox dlq replay` counts as new exactly once (see
        # claim()).
        claim = sql.SQL(
            'INSERT INTO {inbox} AS i (consumer, event_id, topic, partition, "offset", '
            "event_type, status, attempts, last_error, processed_at) "
            "SELECT %(consumer)s, m->>0, m->>1, (m->>2)::integer, (m->>3)::bigint, m->>4, "
            "%(status)s, %(attempts)s, %(last_error)s, now() "
            "FROM json_array_elements(%(events)s::json) AS m "
            "ON CONFLICT (consumer, event_id) DO UPDATE SET topic = excluded.topic, "
            'partition = excluded.partition, "offset" = excluded."offset", '
            "status = excluded.status, attempts = excluded.attempts, "
            "last_error = excluded.last_error, processed_at = excluded.processed_at "
            "WHERE i.status = {replaying} "
            "RETURNING i.event_id"
        ).format(inbox=inbox, replaying=sql.Literal(REPLAYING))
        upsert = sql.SQL(
            "ON CONFLICT (consumer, topic, partition) DO UPDATE SET "
            "start_offset = excluded.start_offset, end_offset = excluded.end_offset, "
            "attempts = excluded.attempts, last_error = excluded.last_error, "
            "updated_at = excluded.updated_at"
        )
        arm = sql.SQL(
            "INSERT INTO {attempts} (consumer, topic, partition, start_offset, end_offset, "
            "attempts, last_error, updated_at) "
            "SELECT %(consumer)s, a->>0, (a->>1)::integer, (a->>2)::bigint, (a->>3)::bigint, "
            "1, NULL, now() FROM json_array_elements(%(arm)s::json) AS a {upsert}"
        ).format(attempts=attempts, upsert=upsert)
        key = sql.SQL("consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s")
        sequences = _name(tables.inbox_sequences)
        statements = {
            "claim": claim,
            "claim_arm": sql.SQL("WITH marker AS ({arm}) {claim}").format(arm=arm, claim=claim),
            "arm": arm,
            "get_marker": sql.SQL(
                "SELECT start_offset, end_offset, attempts, last_error FROM {attempts} WHERE {key}"
            ).format(attempts=attempts, key=key),
            "set_marker": sql.SQL(
                "INSERT INTO {attempts} (consumer, topic, partition, start_offset, end_offset, "
                "attempts, last_error, updated_at) VALUES (%(consumer)s, %(topic)s, "
                "%(partition)s, %(start)s, %(end)s, %(attempts)s, %(last_error)s, now()) "
                "{upsert}"
            ).format(attempts=attempts, upsert=upsert),
            "finish_marker": sql.SQL(
                "UPDATE {attempts} SET attempts = 0, last_error = NULL, updated_at = now() "
                "WHERE {key} AND attempts <> 0"
            ).format(attempts=attempts, key=key),
            # Only the marker still as this process armed it (one attempt, no error): a
            # member letting go late must not erase the count of the partition's new owner.
            "disarm_marker": sql.SQL(
                "UPDATE {attempts} SET attempts = 0, updated_at = now() WHERE {key} "
                "AND start_offset = %(start)s AND end_offset = %(end)s AND attempts = 1 "
                "AND last_error IS NULL"
            ).format(attempts=attempts, key=key),
            "advance_sequence": sql.SQL(
                "INSERT INTO {sequences} AS s (consumer, key, sequence) "
                "VALUES (%(consumer)s, %(key)s, %(sequence)s) "
                "ON CONFLICT (consumer, key) DO UPDATE SET sequence = excluded.sequence, "
                "updated_at = now() WHERE s.sequence < excluded.sequence RETURNING s.sequence"
            ).format(sequences=sequences),
            # A batch handler's list in one statement (see InboxStore.advance_sequences):
            # each key's highest sequence before it (as of the statement's snapshot), and
            # whether the upsert of the list's highest one changed the row (inserted it, or
            # advanced it from exactly the version that snapshot saw: the xmin check).
            "advance_sequences": sql.SQL(
                "WITH ev AS (SELECT k, q FROM unnest(%(keys)s::bytea[], %(sequences)s::bigint[]) "
                "AS t(k, q)), "
                "snap AS (SELECT key, sequence, xmin FROM {sequences} "
                "WHERE consumer = %(consumer)s AND key IN (SELECT k FROM ev)), "
                "up AS (INSERT INTO {sequences} AS s (consumer, key, sequence) "
                "SELECT %(consumer)s, k, max(q) FROM ev GROUP BY k "
                "ON CONFLICT (consumer, key) DO UPDATE SET sequence = excluded.sequence, "
                "updated_at = now() WHERE s.sequence < excluded.sequence "
                "AND s.xmin = (SELECT snap.xmin FROM snap WHERE snap.key = excluded.key) "
                "RETURNING s.key) "
                "SELECT d.k, snap.sequence, up.key IS NOT NULL "
                "FROM (SELECT DISTINCT k FROM ev) AS d "
                "LEFT JOIN snap ON snap.key = d.k LEFT JOIN up ON up.key = d.k"
            ).format(sequences=sequences),
        }
        return cls(**{name: stmt.as_string(None).encode() for name, stmt in statements.items()})


@dataclass(frozen=True)
class InboxStore:
    tables: Tables
    _sql: _Statements = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sql", _Statements.of(self.tables))

    # ------------------------------------------------------------------ inbox rows

    async def claim(
        self,
        db: Db,
        consumer: str,
        events: Sequence[InboxEvent],
        *,
        status: str = PROCESSED,
        attempts: int = 1,
        last_error: str | None = None,
        arm: Sequence[Arm] = (),
    ) -> set[str]:
        """Insert inbox rows; return the event ids that were new (the others are duplicates).

        One statement for any number of events (unnest: one array per column, so the
        statement text and its server-side prepared plan are the same for any batch size).
        A row left ``replaying`` by ``outbox dlq replay`` counts as new exactly once: the
        conditional DO UPDATE flips it, so a second copy of the replayed record is a
        duplicate again. Callers pass distinct event ids (DO UPDATE may not touch one row
        twice in a statement).

        ``arm``: also arm these partitions' attempt markers, as :meth:`arm_markers` does,
        in the same statement (a data-modifying CTE), so that they commit with these rows
        and cost no round trip.
        """
        if not events:
            return set()
        query, params = self._claim_call(consumer, events, status, attempts, last_error, arm)
        cur = await (await _driver(db)).execute(query, params)
        return {row[0] for row in await cur.fetchall()}

    async def begin_and_claim(
        self, conn: Db, consumer: str, events: Sequence[InboxEvent], *, arm: Sequence[Arm] = ()
    ) -> set[str]:
        """Open a transaction on ``conn`` and :meth:`claim` in it, in one round trip.

        ``conn`` must be an idle connection in autocommit mode (a psycopg connection with
        ``autocommit=True``, or one of an ``isolation_level="AUTOCOMMIT"`` engine): the
        driver then sends no BEGIN of its own, which would cost a round trip before the
        claim even in pipeline mode. Here BEGIN and the claim travel in one pipeline.
        Whatever the caller runs next on ``conn`` is inside this transaction, and its
        commit or rollback ends it (the driver acts on the server's transaction state, not
        on its autocommit flag). Raises if the transaction is not open afterwards, so that
        no handler write can ever run outside it.
        """
        assert events
        query, params = self._claim_call(consumer, events, PROCESSED, 1, None, arm)
        raw = await _driver(conn)
        async with raw.pipeline():
            await raw.execute(b"BEGIN")
            cur = await raw.execute(query, params)
        if raw.info.transaction_status != TransactionStatus.INTRANS:
            raise OutboxError("the claim did not leave its transaction open")
        return {row[0] for row in await cur.fetchall()}

    def _claim_call(
        self,
        consumer: str,
        events: Sequence[InboxEvent],
        status: str,
        attempts: int,
        last_error: str | None,
        arm: Sequence[Arm],
    ) -> tuple[bytes, dict[str, Any]]:
        rows = [(e.event_id, e.topic, e.partition, e.offset, e.event_type) for e in events]
        params: dict[str, Any] = {
            "consumer": consumer,
            "status": status,
            "attempts": attempts,
            "last_error": last_error,
            "events": json.dumps(rows),
        }
        if not arm:
            return self._sql.claim, params
        return self._sql.claim_arm, params | {"arm": json.dumps(arm)}

    async def inbox_status(self, db: Executor, consumer: str, event_id: str) -> str | None:
        inbox = self.tables.inbox
        result = await db.execute(
            select(inbox.c.status).where(inbox.c.consumer == consumer, inbox.c.event_id == event_id)
        )
        return result.scalar_one_or_none()

    # -------------------------------------------------------------- attempt marker

    async def marker(self, db: Db, consumer: str, topic: str, partition: int) -> Marker | None:
        key = {"consumer": consumer, "topic": topic, "partition": partition}
        cur = await (await _driver(db)).execute(self._sql.get_marker, key)
        row = await cur.fetchone()
        return Marker(*row) if row is not None else None

    async def set_marker(
        self, db: Db, consumer: str, topic: str, partition: int, marker: Marker
    ) -> None:
        await (await _driver(db)).execute(
            self._sql.set_marker,
            {
                "consumer": consumer,
                "topic": topic,
                "partition": partition,
                "start": marker.start_offset,
                "end": marker.end_offset,
                "attempts": marker.attempts,
                "last_error": marker.last_error,
            },
        )

    async def arm_markers(self, db: Db, consumer: str, runs: Sequence[Arm]) -> None:
        """Arm several partitions' markers in one statement: (topic, partition, start
        offset, end offset) each, one attempt, no error."""
        params = {"consumer": consumer, "arm": json.dumps(runs)}
        await (await _driver(db)).execute(self._sql.arm, params)

    async def finish_marker(self, db: Db, consumer: str, topic: str, partition: int) -> None:
        """Mark the partition's run finished (in the run's own commit)."""
        key = {"consumer": consumer, "topic": topic, "partition": partition}
        await (await _driver(db)).execute(self._sql.finish_marker, key)

    async def disarm_marker(
        self, db: Db, consumer: str, topic: str, partition: int, span: tuple[int, int]
    ) -> None:
        """Disarm the marker only if it is still the one armed for ``span`` (one attempt,
        no error): a member letting go late must not erase the count of the partition's
        new owner (who may be retrying a record that killed a process)."""
        key = {"consumer": consumer, "topic": topic, "partition": partition}
        params = key | {"start": span[0], "end": span[1]}
        await (await _driver(db)).execute(self._sql.disarm_marker, params)

    async def advance_sequence(self, db: Db, consumer: str, key: bytes, sequence: int) -> bool:
        """Record ``sequence`` as the highest applied for ``key`` unless one at least as
        high is recorded; True when it advanced (the event is current, not stale).

        Runs in the handler's transaction: the row stays locked until that commits, so two
        events of one key handled at once (a replay racing the live stream) are ordered by
        the lock and the later one re-checks against the committed value.
        """
        params = {"consumer": consumer, "key": key, "sequence": sequence}
        cur = await (await _driver(db)).execute(self._sql.advance_sequence, params)
        return await cur.fetchone() is not None

    async def advance_sequences(
        self, db: Db, consumer: str, items: Sequence[tuple[bytes, int]]
    ) -> list[bool]:
        """:meth:`advance_sequence` for a list of (key, sequence), in order, in one
        statement: for each item whether it is current (above the highest applied for its
        key, earlier items of the list included); every key ends at its highest sequence.

        The statement upserts each key's highest sequence of the list (locking the row,
        as :meth:`advance_sequence` does) and returns the highest applied before it, read
        from the statement's snapshot; the items are then judged here. That read is only
        trusted when the upsert changed exactly the row version it read (or inserted the
        row): when another transaction moved a key in between (a replay racing the live
        stream), the upsert leaves that row alone, locked, and its items are judged one
        statement each against the committed value, as :meth:`advance_sequence` does.
        """
        if not items:
            return []
        driver = await _driver(db)
        params = {
            "consumer": consumer,
            "keys": [key for key, _ in items],
            "sequences": [sequence for _, sequence in items],
        }
        cur = await driver.execute(self._sql.advance_sequences, params)
        top: dict[bytes, int] = {}
        for key, sequence in items:
            if sequence > top.get(key, -1):
                top[key] = sequence
        # The highest sequence applied for each key before the list (-1: none; sequences
        # are non-negative); a key missing here was moved by another transaction.
        applied: dict[bytes, int] = {}
        for key, before, changed in await cur.fetchall():
            key = bytes(key)
            if before is not None and before >= top[key]:
                applied[key] = before  # nothing of the list is current for this key
            elif changed:
                applied[key] = -1 if before is None else before
        current: list[bool] = []
        for key, sequence in items:
            if key not in applied:
                current.append(await self.advance_sequence(driver, consumer, key, sequence))
            elif sequence > applied[key]:
                applied[key] = sequence
                current.append(True)
            else:
                current.append(False)
        return current

    # ---------------------------------------------------------------- dead letters

    async def add_dead_letter(
        self,
        db: Executor,
        consumer: str,
        event: InboxEvent,
        *,
        error_class: str,
        error_message: str,
        attempts: int,
        dlq_topic: str,
        dlq_partition: int | None,
        dlq_offset: int | None,
        dlq_refused: str | None = None,
    ) -> None:
        t = self.tables.dead_letters
        values: dict[str, Any] = {
            "topic": event.topic,
            "partition": event.partition,
            "offset": event.offset,
            "event_type": event.event_type,
            "key": event.key,
            "value": event.record_value,
            "header_names": [h for h, _ in event.headers],
            "header_values": [v for _, v in event.headers],
            "error_class": error_class,
            "error_message": error_message,
            "attempts": attempts,
            "dlq_topic": dlq_topic,
            "dlq_partition": dlq_partition,
            "dlq_offset": dlq_offset,
            "dlq_refused": dlq_refused,
            "dead_lettered_at": func.now(),
        }
        stmt = insert(t).values(consumer=consumer, event_id=event.event_id, **values)
        # A replayed event that fails again updates its row; `replays` is kept.
        await db.execute(
            stmt.on_conflict_do_update(index_elements=["consumer", "event_id"], set_=values)
        )

    def _dead_letter_query(self, f: DeadLetterFilter) -> Any:
        t, inbox = self.tables.dead_letters, self.tables.inbox
        query = select(t, inbox.c.status).select_from(
            t.outerjoin(
                inbox, and_(inbox.c.consumer == t.c.consumer, inbox.c.event_id == t.c.event_id)
            )
        )
        for col, value in (
            (t.c.consumer, f.consumer),
            (t.c.event_id, f.event_id),
            (t.c.topic, f.topic),
            (t.c.event_type, f.event_type),
            (t.c.error_class, f.error_class),
        ):
            if value is not None:
                query = query.where(col == value)
        if f.before is not None:
            query = query.where(t.c.dead_lettered_at < f.before)
        if f.after is not None:
            query = query.where(t.c.dead_lettered_at >= f.after)
        if f.group is not None:
            query = query.where(func.md5(self._error_pattern()) == f.group)
        if f.keys is not None:
            query = query.where(tuple_(t.c.consumer, t.c.event_id).in_(list(f.keys) or [("", "")]))
        return query

    def _error_pattern(self) -> Any:
        """The error class and its message with the parts that differ per event blanked:
        UUIDs, then hex ids of 8+ digits, then numbers; cut at 200 characters."""
        t = self.tables.dead_letters
        message = func.left(t.c.error_message, 200)
        for pattern, blank in (
            (_UUID, "<uuid>"),
            ("\\m(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\\M", "<hex>"),
            ("[0-9]+", "<n>"),
        ):
            message = func.regexp_replace(message, pattern, blank, "g")
        return t.c.error_class + ": " + message

    async def dead_letter_groups(
        self, db: Executor, f: DeadLetterFilter, limit: int = 100
    ) -> list[DeadLetterGroup]:
        """The filtered dead letters grouped by :class:`DeadLetterGroup`, largest first."""
        t = self.tables.dead_letters
        pattern = self._error_pattern().label("pattern")
        inner = (
            self._dead_letter_query(f)
            .with_only_columns(t.c.consumer, t.c.error_class, t.c.dead_lettered_at, pattern)
            .subquery()
        )
        query = (
            select(
                func.md5(inner.c.pattern),
                func.min(inner.c.error_class),
                inner.c.pattern,
                func.count(),
                func.array_agg(func.distinct(inner.c.consumer)),
                func.min(inner.c.dead_lettered_at),
                func.max(inner.c.dead_lettered_at),
            )
            .group_by(inner.c.pattern)
            .order_by(func.count().desc(), inner.c.pattern)
            .limit(limit)
        )
        rows = (await db.execute(query)).all()
        return [
            DeadLetterGroup(g, cls, p.split(": ", 1)[-1], int(n), tuple(c), first, last)
            for g, cls, p, n, c, first, last in rows
        ]

    async def count_dead_letters(self, db: Executor, f: DeadLetterFilter) -> int:
        query = self._dead_letter_query(f).with_only_columns(func.count())
        return int((await db.execute(query)).scalar_one())

    async def dead_letters_by_day(self, db: Executor, days: int) -> list[tuple[dt.date, int]]:
        """Dead letters per day (database clock) over the last ``days`` days, oldest first."""
        t = self.tables.dead_letters
        day = func.date_trunc("day", t.c.dead_lettered_at).label("day")
        query = (
            select(day, func.count())
            .where(t.c.dead_lettered_at >= func.now() - dt.timedelta(days=days))
            .group_by(day)
            .order_by(day)
        )
        return [(d.date(), int(n)) for d, n in (await db.execute(query)).all()]

    async def dead_letters(
        self,
        db: Executor,
        f: DeadLetterFilter,
        limit: int | None = None,
        offset: int = 0,
        newest_first: bool = False,
    ) -> list[DeadLetter]:
        t = self.tables.dead_letters
        order = (
            (t.c.dead_lettered_at.desc(), t.c.event_id.desc())
            if newest_first
            else (t.c.dead_lettered_at, t.c.event_id)
        )
        query = self._dead_letter_query(f).order_by(*order).offset(offset or None)
        if limit is not None:
            query = query.limit(limit)
        out = []
        for row in (await db.execute(query)).mappings():
            data = dict(row)
            names, values = data.pop("header_names"), data.pop("header_values")
            data["headers"] = tuple(zip(names, (bytes(v) for v in values), strict=True))
            data["inbox_status"] = data.pop("status")
            out.append(DeadLetter(**data))
        return out

    async def mark_replaying(self, db: Executor, letter: DeadLetter) -> bool:
        """Let the next copy of this event through the inbox once. False if it was
        already processed (a replay must never apply an event twice)."""
        inbox, t = self.tables.inbox, self.tables.dead_letters
        result = await db.execute(
            update(inbox)
            .where(
                inbox.c.consumer == letter.consumer,
                inbox.c.event_id == letter.event_id,
                or_(inbox.c.status == DEAD_LETTERED, inbox.c.status == REPLAYING),
            )
            .values(status=REPLAYING)
        )
        if result.rowcount == 0:  # type: ignore[attr-defined]
            status = await self.inbox_status(db, letter.consumer, letter.event_id)
            # No row at all: retention removed it, so the event is unknown to the inbox
            # and the replayed copy will be processed like a new one.
            if status is not None:
                return False
        await db.execute(
            update(t)
            .where(t.c.consumer == letter.consumer, t.c.event_id == letter.event_id)
            .values(replays=t.c.replays + 1, replayed_at=func.now())
        )
        return True

    async def purge_dead_letters(self, db: Executor, f: DeadLetterFilter) -> int:
        t = self.tables.dead_letters
        keys = self._dead_letter_query(f).with_only_columns(t.c.consumer, t.c.event_id)
        result = await db.execute(delete(t).where(tuple_(t.c.consumer, t.c.event_id).in_(keys)))
        return int(result.rowcount)  # type: ignore[attr-defined]

    def forget_consumer(self, consumer: str) -> list[Any]:
        """Statements deleting everything the inbox keeps for ``consumer`` (its processed
        events, attempt markers, dead letters, sequences): a test harness starts afresh."""
        t = self.tables
        return [
            delete(table).where(table.c.consumer == consumer)
            for table in (t.inbox, t.inbox_attempts, t.dead_letters, t.inbox_sequences)
        ]

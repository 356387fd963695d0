"""The inbox's database access: what the consumer and the operator tools run, with the SQL
text of ``inbox/sql.py``. Nothing else in ``inbox`` runs statements.

Every method takes the caller's session or connection so that the inbox row, the
handler's writes and the attempt marker share the caller's transaction.

The statements of the hot path (the claim, the attempt marker, the sequence guard) talk to
psycopg directly, as the relay does: at a few events per transaction, SQLAlchemy Core's
execute path (compiled-cache lookup, execution context, result wrapping, the greenlet
hop) cost more CPU than the round trip itself. They are composed once with
``psycopg.sql`` (``inbox/sql.py``: schema and table prefix quoted as identifiers, values
always bound) and take a psycopg connection, or a SQLAlchemy session or connection whose
driver connection is then used (same connection, same transaction). They never ask for
server-side prepared statements themselves: whether psycopg prepares them is the
connection's ``prepare_threshold``, set where connections are made (``outbox/db.py``), so a
pooler that cannot keep them (PgBouncer in transaction mode) is handled in one place. The
operator statements (dead letters, replay) stay on SQLAlchemy Core: they are rare.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import delete, func, or_, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from inbox.event import InboxEvent
from inbox.sql import (
    DEAD_LETTERED,
    PROCESSED,
    REPLAYING,
    Statements,
    capped_history,
    dead_letter_groups_query,
    dead_letter_query,
)
from outbox.errors import OutboxError
from outbox.ops.deadletters import (
    STATES,
    Attempt,
    DeadLetter,
    DeadLetterFilter,
    DeadLetterGroup,
    state_of,
)
from outbox.tables import Tables
from outbox.text import storable

Executor = AsyncSession | AsyncConnection
# A psycopg connection of the hot path (autocommit mode: see begin_and_claim).
Driver = psycopg.AsyncConnection[Any]
Db = Executor | Driver
# (topic, partition, start offset, end offset): arm one partition's attempt marker.
Arm = tuple[str, int, int, int]


@dataclass(frozen=True)
class Marker:
    """The durable attempt marker of one partition (see ``tables._inbox_attempts``)."""

    start_offset: int
    end_offset: int
    attempts: int
    last_error: str | None


async def _driver(db: Db) -> Driver:
    """The psycopg connection under ``db`` (a session's is its current transaction's)."""
    if isinstance(db, psycopg.AsyncConnection):
        return db
    conn = await db.connection() if isinstance(db, AsyncSession) else db
    driver = (await conn.get_raw_connection()).driver_connection
    assert isinstance(driver, psycopg.AsyncConnection)
    return driver


@dataclass(frozen=True)
class InboxStore:
    tables: Tables
    _sql: Statements = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sql", Statements.of(self.tables))

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
        history: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Record a dead letter (a replayed event that fails again updates its row: the
        error columns say the latest failure, ``history`` gets the new attempts appended,
        ``replays`` is kept)."""
        t = self.tables.dead_letters
        values: dict[str, Any] = {
            "topic": event.topic,
            "partition": event.partition,
            "offset": event.offset,
            "event_type": event.event_type,
            "key": event.key,
            "value": event.record_value,
            # Names as text can hold them (a NUL escaped); the dead-letter topic has them exact.
            "header_names": [storable(h) for h, _ in event.headers],
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
        stmt = insert(t).values(
            consumer=consumer, event_id=event.event_id, history=list(history), **values
        )
        both = t.c.history.op("||")(stmt.excluded.history)
        await db.execute(
            stmt.on_conflict_do_update(
                index_elements=["consumer", "event_id"],
                set_={**values, "history": capped_history(both)},
            )
        )

    async def dead_letter_groups(
        self, db: Executor, f: DeadLetterFilter, limit: int = 100
    ) -> list[DeadLetterGroup]:
        """The filtered dead letters grouped by :class:`DeadLetterGroup`, largest first,
        each with its counts by state and how many were ever replayed."""
        query = dead_letter_groups_query(self.tables, f, limit)
        groups = []
        for g, cls, p, frame, n, c, first, last, replayed, dead_again, *states in (
            await db.execute(query)
        ).all():
            groups.append(
                DeadLetterGroup(
                    g,
                    cls,
                    p.split(": ", 1)[-1],
                    int(n),
                    tuple(c),
                    first,
                    last,
                    frame or None,
                    dict(zip(STATES, map(int, states), strict=True)),
                    int(replayed),
                    int(dead_again),
                )
            )
        return groups

    async def count_by_state(self, db: Executor, f: DeadLetterFilter) -> dict[str, int]:
        """How many of the filtered dead letters are in each state (STATES), zeros too."""
        inbox = self.tables.inbox
        query = (
            dead_letter_query(self.tables, f)
            .with_only_columns(inbox.c.status, func.count())
            .group_by(inbox.c.status)
        )
        counts = dict.fromkeys(STATES, 0)
        for status, n in (await db.execute(query)).all():
            counts[state_of(status)] = counts.get(state_of(status), 0) + int(n)
        return counts

    async def count_dead_letters(self, db: Executor, f: DeadLetterFilter) -> int:
        query = dead_letter_query(self.tables, f).with_only_columns(func.count())
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

    async def dead_letter_ids(
        self, db: Executor, prefix: str, consumer: str | None, limit: int
    ) -> tuple[list[str], int]:
        """Up to ``limit`` distinct event ids of dead letters that start with ``prefix``
        (``prefix`` itself first when it is one), and how many there are."""
        t = self.tables.dead_letters
        ids = select(t.c.event_id).where(t.c.event_id.startswith(prefix, autoescape=True))
        if consumer is not None:
            ids = ids.where(t.c.consumer == consumer)
        found = ids.distinct().subquery()
        query = (
            select(found.c.event_id, func.count().over())
            .order_by((found.c.event_id == prefix).desc(), found.c.event_id)
            .limit(limit)
        )
        rows = (await db.execute(query)).all()
        return [str(r[0]) for r in rows], int(rows[0][1]) if rows else 0

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
        query = dead_letter_query(self.tables, f).order_by(*order).offset(offset or None)
        if limit is not None:
            query = query.limit(limit)
        out = []
        for row in (await db.execute(query)).mappings():
            data = dict(row)
            names, values = data.pop("header_names"), data.pop("header_values")
            data["headers"] = tuple(zip(names, (bytes(v) for v in values), strict=True))
            data["inbox_status"] = data.pop("status")
            data["history"] = tuple(Attempt.from_json(a) for a in data["history"] or ())
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
        keys = dead_letter_query(self.tables, f).with_only_columns(t.c.consumer, t.c.event_id)
        result = await db.execute(delete(t).where(tuple_(t.c.consumer, t.c.event_id).in_(keys)))
        return int(result.rowcount)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ consumer stats

    async def add_stats(self, db: Executor, consumer: str, counts: dict[str, float]) -> None:
        """Add ``counts`` (processed, handler_seconds, dead_lettered, retries, duplicates)
        to ``consumer``'s row of the current minute (database clock)."""
        t = self.tables.consumer_stats
        minute = func.date_trunc("minute", func.now())
        stmt = insert(t).values(consumer=consumer, minute=minute, **counts)
        await db.execute(
            stmt.on_conflict_do_update(
                index_elements=["consumer", "minute"],
                set_={name: t.c[name] + stmt.excluded[name] for name in counts},
            )
        )

    async def forget_stats(self, db: Executor, consumer: str, older_than: dt.timedelta) -> None:
        t = self.tables.consumer_stats
        await db.execute(
            delete(t).where(t.c.consumer == consumer, t.c.minute < func.now() - older_than)
        )

    def forget_consumer(self, consumer: str) -> list[Any]:
        """Statements deleting everything the inbox keeps for ``consumer`` (its processed
        events, attempt markers, dead letters, sequences): a test harness starts afresh."""
        t = self.tables
        return [
            delete(table).where(table.c.consumer == consumer)
            for table in (
                t.inbox,
                t.inbox_attempts,
                t.dead_letters,
                t.inbox_sequences,
                t.consumer_stats,
            )
        ]

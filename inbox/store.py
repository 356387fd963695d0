"""The inbox's SQL, in one place. Nothing else in ``inbox`` builds statements.

Every method takes the caller's session or connection so that the inbox row, the
handler's writes and the attempt marker share the caller's transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import (
    BigInteger,
    Integer,
    Text,
    and_,
    bindparam,
    column,
    delete,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from inbox.event import InboxEvent
from outbox.errors import OutboxError
from outbox.tables import Tables

Executor = AsyncSession | AsyncConnection

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


@dataclass(frozen=True)
class MarkerWrite:
    """Set one partition's attempt marker to ``marker``."""

    topic: str
    partition: int
    marker: Marker


@dataclass(frozen=True)
class DeadLetter:
    consumer: str
    event_id: str
    topic: str
    partition: int
    offset: int
    event_type: str | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    error_class: str
    error_message: str
    attempts: int
    dlq_topic: str
    dlq_partition: int | None
    dlq_offset: int | None
    dlq_refused: str | None  # the topic refused the record as too large (kept here only)
    dead_lettered_at: dt.datetime
    replays: int
    replayed_at: dt.datetime | None
    inbox_status: str | None


@dataclass(frozen=True)
class DeadLetterFilter:
    consumer: str | None = None
    event_id: str | None = None
    topic: str | None = None
    event_type: str | None = None
    error_class: str | None = None
    before: dt.datetime | None = None


@dataclass(frozen=True)
class _Claim:
    """A claim statement, and the same as psycopg query text for :meth:`InboxStore.begin_and_claim`
    (rendered once, with the defaults of the parameters the statement binds itself)."""

    stmt: Any
    text: bytes
    defaults: dict[str, Any]

    @classmethod
    def of(cls, stmt: Any) -> _Claim:
        compiled = stmt.compile(dialect=PGDialect_psycopg())  # type: ignore[no-untyped-call]
        return cls(stmt, str(compiled).encode(), dict(compiled.params))


@dataclass(frozen=True)
class InboxStore:
    tables: Tables
    _claim: _Claim = field(init=False, repr=False, compare=False)
    _claim_arm: _Claim = field(init=False, repr=False, compare=False)
    _claim_arm_many: _Claim = field(init=False, repr=False, compare=False)
    _get_marker: Any = field(init=False, repr=False, compare=False)
    _set_marker: Any = field(init=False, repr=False, compare=False)
    _finish_marker: Any = field(init=False, repr=False, compare=False)
    _disarm_marker: Any = field(init=False, repr=False, compare=False)
    _set_markers: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The hot statements are built once: SQLAlchemy then reuses their compiled form
        # (memoized cache key), instead of rebuilding and re-keying them per batch.
        for name, stmt in (
            ("_claim", _Claim.of(self._claim_statement())),
            (
                "_claim_arm",
                _Claim.of(
                    self._claim_statement().add_cte(self._set_marker_statement().cte("marker"))
                ),
            ),
            (
                "_claim_arm_many",
                _Claim.of(
                    self._claim_statement().add_cte(self._set_markers_statement().cte("marker"))
                ),
            ),
            ("_get_marker", self._get_marker_statement()),
            ("_set_marker", self._set_marker_statement()),
            ("_finish_marker", self._finish_marker_statement()),
            ("_disarm_marker", self._disarm_marker_statement()),
            ("_set_markers", self._set_markers_statement()),
        ):
            object.__setattr__(self, name, stmt)

    # ------------------------------------------------------------------ inbox rows

    def _claim_statement(self) -> Any:
        inbox = self.tables.inbox
        src = (
            func.unnest(
                bindparam("ids", type_=ARRAY(Text)),
                bindparam("topics", type_=ARRAY(Text)),
                bindparam("partitions", type_=ARRAY(Integer)),
                bindparam("offsets", type_=ARRAY(BigInteger)),
                bindparam("types", type_=ARRAY(Text)),
            )
            .table_valued(
                column("event_id"),
                column("topic"),
                column("partition"),
                column("offset"),
                column("event_type"),
            )
            .render_derived(name="m")
        )
        rows = select(
            bindparam("p_consumer", type_=Text),
            src.c.event_id,
            src.c.topic,
            src.c.partition,
            src.c.offset,
            src.c.event_type,
            bindparam("p_status", type_=Text),
            bindparam("p_attempts", type_=Integer),
            bindparam("p_last_error", type_=Text),
            func.now(),
        )
        stmt = insert(inbox).from_select(
            [
                "consumer",
                "event_id",
                "topic",
                "partition",
                "offset",
                "event_type",
                "status",
                "attempts",
                "last_error",
                "processed_at",
            ],
            rows,
        )
        return stmt.on_conflict_do_update(
            index_elements=["consumer", "event_id"],
            set_={
                name: stmt.excluded[name]
                for name in (
                    "topic",
                    "partition",
                    "offset",
                    "status",
                    "attempts",
                    "last_error",
                    "processed_at",
                )
            },
            where=inbox.c.status == REPLAYING,
        ).returning(inbox.c.event_id)

    async def claim(
        self,
        db: Executor,
        consumer: str,
        events: Sequence[InboxEvent],
        *,
        status: str = PROCESSED,
        attempts: int = 1,
        last_error: str | None = None,
        marker: MarkerWrite | None = None,
        arm: Sequence[tuple[str, int, int, int]] = (),
    ) -> set[str]:
        """Insert inbox rows; return the event ids that were new (the others are duplicates).

        One statement for any number of events (unnest: one array per column, so the
        statement text and its server-side prepared plan are the same for any batch size).
        A row left ``replaying`` by ``outbox dlq replay`` counts as new exactly once: the
        conditional DO UPDATE flips it, so a second copy of the replayed record is a
        duplicate again. Callers pass distinct event ids (DO UPDATE may not touch one row
        twice in a statement).

        ``marker``: also write the partition's attempt marker, in the same statement (a
        data-modifying CTE), so that it commits with these rows and costs no round trip.
        ``arm``: likewise arm several partitions' markers, as :meth:`arm_markers` does.
        """
        if not events:
            return set()
        stmt, params = self._claim_call(
            consumer, events, status, attempts, last_error, marker=marker, arm=arm
        )
        result = await db.execute(stmt.stmt, params)
        return set(result.scalars())

    async def begin_and_claim(
        self,
        conn: AsyncConnection,
        consumer: str,
        events: Sequence[InboxEvent],
        *,
        marker: MarkerWrite | None = None,
        arm: Sequence[tuple[str, int, int, int]] = (),
    ) -> set[str]:
        """Open a transaction on ``conn`` and :meth:`claim` in it, in one round trip.

        ``conn`` must be an idle connection in autocommit mode (``isolation_level=
        "AUTOCOMMIT"``): its driver then sends no BEGIN of its own, which would cost a round
        trip before the claim even in pipeline mode. Here BEGIN and the claim travel in one
        pipeline. Whatever the caller runs next on ``conn`` is inside this transaction, and
        its commit or rollback ends it (the driver acts on the server's transaction state,
        not on its autocommit flag). Raises if the transaction is not open afterwards, so
        that no handler write can ever run outside it.
        """
        assert events
        stmt, params = self._claim_call(
            consumer, events, PROCESSED, 1, None, marker=marker, arm=arm
        )
        raw = (await conn.get_raw_connection()).driver_connection
        assert isinstance(raw, psycopg.AsyncConnection)
        async with raw.pipeline():
            await raw.execute(b"BEGIN")
            cur = await raw.execute(stmt.text, stmt.defaults | params)
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
        *,
        marker: MarkerWrite | None,
        arm: Sequence[tuple[str, int, int, int]],
    ) -> tuple[_Claim, dict[str, Any]]:
        stmt, params = self._claim, {}
        if arm:
            assert marker is None
            stmt, params = self._claim_arm_many, self._arm_params(consumer, arm)
        if marker is not None:
            key = {"m_consumer": consumer, "m_topic": marker.topic, "m_partition": marker.partition}
            stmt, params = self._claim_arm, key | self._marker_values(marker.marker)
        return stmt, params | {
            "p_consumer": consumer,
            "p_status": status,
            "p_attempts": attempts,
            "p_last_error": last_error,
            "ids": [e.event_id for e in events],
            "topics": [e.topic for e in events],
            "partitions": [e.partition for e in events],
            "offsets": [e.offset for e in events],
            "types": [e.event_type for e in events],
        }

    async def inbox_status(self, db: Executor, consumer: str, event_id: str) -> str | None:
        inbox = self.tables.inbox
        result = await db.execute(
            select(inbox.c.status).where(inbox.c.consumer == consumer, inbox.c.event_id == event_id)
        )
        return result.scalar_one_or_none()

    # -------------------------------------------------------------- attempt marker

    def _marker_key(self) -> Any:
        t = self.tables.inbox_attempts
        return and_(
            t.c.consumer == bindparam("m_consumer"),
            t.c.topic == bindparam("m_topic"),
            t.c.partition == bindparam("m_partition"),
        )

    def _get_marker_statement(self) -> Any:
        t = self.tables.inbox_attempts
        return select(t.c.start_offset, t.c.end_offset, t.c.attempts, t.c.last_error).where(
            self._marker_key()
        )

    def _set_marker_statement(self) -> Any:
        t = self.tables.inbox_attempts
        values: dict[str, Any] = {
            "start_offset": bindparam("m_start_offset", type_=BigInteger),
            "end_offset": bindparam("m_end_offset", type_=BigInteger),
            "attempts": bindparam("m_attempts", type_=Integer),
            "last_error": bindparam("m_last_error", type_=Text),
            "updated_at": func.now(),
        }
        keys: dict[str, Any] = {n: bindparam(f"m_{n}") for n in ("consumer", "topic", "partition")}
        stmt = insert(t).values(**keys, **values)
        return stmt.on_conflict_do_update(
            index_elements=["consumer", "topic", "partition"], set_=values
        )

    def _finish_marker_statement(self) -> Any:
        t = self.tables.inbox_attempts
        return (
            update(t)
            .where(self._marker_key(), t.c.attempts != 0)
            .values(attempts=0, last_error=None, updated_at=func.now())
        )

    def _disarm_marker_statement(self) -> Any:
        t = self.tables.inbox_attempts
        return (
            update(t)
            .where(
                self._marker_key(),
                t.c.start_offset == bindparam("m_start_offset", type_=BigInteger),
                t.c.end_offset == bindparam("m_end_offset", type_=BigInteger),
                t.c.attempts == 1,
                t.c.last_error.is_(None),
            )
            .values(attempts=0, updated_at=func.now())
        )

    async def marker(
        self, db: Executor, consumer: str, topic: str, partition: int
    ) -> Marker | None:
        key = {"m_consumer": consumer, "m_topic": topic, "m_partition": partition}
        row = (await db.execute(self._get_marker, key)).one_or_none()
        return Marker(*row) if row is not None else None

    async def set_marker(
        self, db: Executor, consumer: str, topic: str, partition: int, marker: Marker
    ) -> None:
        key = {"m_consumer": consumer, "m_topic": topic, "m_partition": partition}
        await db.execute(self._set_marker, key | self._marker_values(marker))

    @staticmethod
    def _marker_values(marker: Marker) -> dict[str, Any]:
        return {
            "m_start_offset": marker.start_offset,
            "m_end_offset": marker.end_offset,
            "m_attempts": marker.attempts,
            "m_last_error": marker.last_error,
        }

    def _set_markers_statement(self) -> Any:
        t = self.tables.inbox_attempts
        src = (
            func.unnest(
                bindparam("m_topics", type_=ARRAY(Text)),
                bindparam("m_partitions", type_=ARRAY(Integer)),
                bindparam("m_starts", type_=ARRAY(BigInteger)),
                bindparam("m_ends", type_=ARRAY(BigInteger)),
            )
            .table_valued(
                column("topic"), column("partition"), column("start_offset"), column("end_offset")
            )
            .render_derived(name="m")
        )
        rows = select(
            bindparam("m_consumer", type_=Text),
            src.c.topic,
            src.c.partition,
            src.c.start_offset,
            src.c.end_offset,
            bindparam("m_attempts", type_=Integer),
            func.now(),
        )
        stmt = insert(t).from_select(
            [
                "consumer",
                "topic",
                "partition",
                "start_offset",
                "end_offset",
                "attempts",
                "updated_at",
            ],
            rows,
        )
        return stmt.on_conflict_do_update(
            index_elements=["consumer", "topic", "partition"],
            set_={
                "start_offset": stmt.excluded.start_offset,
                "end_offset": stmt.excluded.end_offset,
                "attempts": stmt.excluded.attempts,
                "last_error": None,
                "updated_at": stmt.excluded.updated_at,
            },
        )

    async def arm_markers(
        self, db: Executor, consumer: str, runs: Sequence[tuple[str, int, int, int]]
    ) -> None:
        """Arm several partitions' markers in one statement: (topic, partition, start
        offset, end offset) each, one attempt, no error."""
        await db.execute(self._set_markers, self._arm_params(consumer, runs))

    @staticmethod
    def _arm_params(consumer: str, runs: Sequence[tuple[str, int, int, int]]) -> dict[str, Any]:
        return {
            "m_consumer": consumer,
            "m_topics": [topic for topic, _, _, _ in runs],
            "m_partitions": [partition for _, partition, _, _ in runs],
            "m_starts": [start for _, _, start, _ in runs],
            "m_ends": [end for _, _, _, end in runs],
            "m_attempts": 1,
        }

    async def finish_marker(self, db: Executor, consumer: str, topic: str, partition: int) -> None:
        """Mark the partition's run finished (in the run's own commit)."""
        key = {"m_consumer": consumer, "m_topic": topic, "m_partition": partition}
        await db.execute(self._finish_marker, key)

    async def advance_sequence(
        self, db: Executor, consumer: str, key: bytes, sequence: int
    ) -> bool:
        """Record ``sequence`` as the highest applied for ``key`` unless one at least as
        high is recorded; True when it advanced (the event is current, not stale).

        Runs in the handler's transaction: the row stays locked until that commits, so two
        events of one key handled at once (a replay racing the live stream) are ordered by
        the lock and the later one re-checks against the committed value.
        """
        t = self.tables.inbox_sequences
        new = insert(t).values(consumer=consumer, key=key, sequence=sequence)
        stmt = new.on_conflict_do_update(
            index_elements=[t.c.consumer, t.c.key],
            set_={"sequence": new.excluded.sequence, "updated_at": func.now()},
            where=t.c.sequence < new.excluded.sequence,
        ).returning(t.c.sequence)
        result = await db.execute(stmt)
        return result.first() is not None

    async def disarm_marker(
        self, db: Executor, consumer: str, topic: str, partition: int, span: tuple[int, int]
    ) -> None:
        """Disarm the marker only if it is still the one armed for ``span`` (one attempt,
        no error): a member letting go late must not erase the count of the partition's
        new owner (who may be retrying a record that killed a process)."""
        key = {"m_consumer": consumer, "m_topic": topic, "m_partition": partition}
        await db.execute(
            self._disarm_marker, key | {"m_start_offset": span[0], "m_end_offset": span[1]}
        )

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
        return query

    async def dead_letters(
        self, db: Executor, f: DeadLetterFilter, limit: int | None = None
    ) -> list[DeadLetter]:
        t = self.tables.dead_letters
        query = self._dead_letter_query(f).order_by(t.c.dead_lettered_at, t.c.event_id)
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

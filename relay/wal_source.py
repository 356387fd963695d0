"""The relay's WAL source: events read from a logical replication slot, in commit order.

One relay reads a slot at a time: it holds a session advisory lock (relay/wal_store.py)
on the connection that reads; the others stand by, trying the lock every
``relay.poll_interval_seconds``, and the first to get it after the reader's connection
dies takes over from the slot's confirmed position.

A read (``wal.batch_changes`` records at most, whole transactions) goes through a cursor,
a few hundred records at a time, so neither a huge transaction nor large messages are
held at once. Its events are split by key over ``relay.pipelines`` streams; each stream
publishes batch after batch (up to ``relay.batch_size`` events or its share of
``relay.max_inflight_bytes``), each waited for until Kafka has acknowledged every event in
it (or refused it for good: the failed table), so a key's events go out in commit order
while one stream's batch waits for acks and another's is built. The slot is advanced —
at the end of a read, and at a transaction end every ``CHECKPOINT_SECONDS`` within a long
one — only once every stream has settled every event read before that point; a crash
re-reads from there (duplicates, never loss: the inbox dedupes).

A slot that disappears or is invalidated under the relay (``wal_status = 'lost'``: past
``max_slot_wal_keep_size``) stops it at once with :class:`~relay.errors.SlotLost`: the
WAL it held may be gone, and a new slot would silently start from now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox import envelope, pgoutput, wal_codec
from outbox.db import unavailable, unprepared_connection
from outbox.dberrors import is_transient
from outbox.errors import DatabaseUnavailable, SchemaMissing, TopicMissing, WalSlotMismatch
from outbox.ops.store import WAL_SLOT
from outbox.ops.wal_health import WalGauges
from outbox.ops.wal_slot import SlotState
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay.errors import PartitionUnavailable, ProducerBroken, RecordRejected, SlotLost, SlotMissing
from relay.failed import report_moved
from relay.kafka_state import KafkaState
from relay.metrics import RelayMetrics
from relay.outcome import Outcome
from relay.publisher import Publisher
from relay.store import CE_ID, EVENT_TYPE, KEY, PAYLOAD, TOPIC, ClaimedRow, RelayStore
from relay.table_gate import TableGate
from relay.waiting import sleep_unless
from relay.wal_store import WalStore, lsn_int, lsn_text

log = logging.getLogger("relay.wal")

# Records fetched from the read's cursor at a time (at most; fewer when they are large).
FIRST_FETCH, FETCH_RECORDS = 16, 500
# How often the slot's gauges are read.
GAUGE_SECONDS = 5.0
# Within a long read, confirm the slot at a transaction end this often (each advance
# decodes the WAL from the slot's restart position: not at every transaction).
CHECKPOINT_SECONDS = 5.0
# How long rows of a missing topic wait before the topic is asked for again.
MISSING_TOPIC_RECHECK_SECONDS = 5.0
# SQLSTATEs of a slot gone under the reader: dropped (undefined_object), invalidated
# (object_not_in_prerequisite_state: "This slot has been invalidated because it exceeded
# the maximum reserved size").
_DROPPED, _INVALID = "42704", "55000"


def _row(event: wal_codec.WalEvent, ce_time: str) -> ClaimedRow:
    """A WAL event in the claimed-row layout the publisher takes (relay/store.py); id,
    lane, attempts and fingerprint only matter if it goes to the failed table."""
    return (
        0,
        0,
        event.topic,
        event.key,
        event.payload,
        str(event.event_id),
        event.event_type,
        event.source,
        event.content_type,
        event.headers,
        ce_time,
        0,
        b"",
    )


def _observed(task: asyncio.Task[None]) -> None:
    """A batch's failure is raised where the stream is waited for; one cancelled after a
    failure elsewhere is read here, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Stream:
    """One key-disjoint share of a read's events: the batch being filled, and the one
    being published (at most one at a time, so the stream's events stay in order)."""

    def __init__(self) -> None:
        self.rows: list[ClaimedRow] = []
        self.bytes = 0
        self.sending: asyncio.Task[None] | None = None

    async def settled(self) -> None:
        """Until the batch being published is settled (its failure raised here)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            await sending


class WalSource:
    def __init__(
        self,
        settings: OutboxSettings,
        publisher: Publisher,
        kafka: KafkaState,
        metrics: RelayMetrics,
    ) -> None:
        self._settings = settings
        self._store = WalStore(settings)
        self._relay_store = RelayStore(settings)
        self._publisher = publisher
        self._kafka = kafka
        self._metrics = metrics
        self.database = Dependency("database", log)
        self._db_retry = RetryPolicy.from_settings(settings.retry)
        r = settings.relay
        self._row_retry = RetryPolicy(
            settings.retry.base_seconds, settings.retry.cap_seconds, r.max_attempts
        )
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self.reading = False  # holds the reader lock
        self.confirmed: int | None = None  # the slot's confirmed LSN, as last seen or set
        self._last_commit_at = 0.0  # loop time of the last transaction end read
        self._attempts: dict[str, int] = {}  # event id -> rejections so far
        self._streams = max(1, r.pipelines)
        # Two batches per stream may be around at once (one filling, one in flight).
        self._batch_bytes = max(1, r.max_inflight_bytes // (2 * self._streams))
        self._side: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._cut = False  # a publish given up on stopping: confirm nothing more
        # Switching between the sources: table rows older than a transaction go first.
        self._gate = TableGate(self._store.table_oldest, self._side_conn)
        # Commit time (Unix) of the oldest transaction read but not confirmed yet, if any.
        self._oldest: float | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        idle = self._settings.relay.min_poll_interval_seconds
        self._last_commit_at = loop.time()
        try:
            while not stopping.is_set():
                try:
                    if self._conn is None:
                        self._conn = await unprepared_connection(self._settings, "outbox-relay-wal")
                    if not self.reading:
                        await self._take_slot(stopping)
                        continue
                    busy = await self._read(stopping)
                    if busy and stopping.is_set():
                        break
                    failures = 0
                    self.database.ok()
                    if busy:
                        idle = self._settings.relay.min_poll_interval_seconds
                        continue
                    if loop.time() - self._last_commit_at >= self._settings.wal.heartbeat_seconds:
                        await self._conn.execute(
                            self._store.heartbeat, {"prefix": self._heartbeat_prefix}
                        )
                        self._last_commit_at = loop.time()
                        continue
                    await sleep_unless(stopping, idle)
                    idle = min(idle * 2, self._settings.relay.poll_interval_seconds)
                except psycopg.errors.UndefinedTable as exc:
                    raise SchemaMissing(
                        f"relay table missing ({exc.diag.message_primary})"
                    ) from None
                except psycopg.Error as exc:
                    self._slot_gone(exc)
                    if not is_transient(exc):
                        raise unavailable(exc) from None
                    await self._outage(exc, stopping, failures)
                    failures += 1
                except DatabaseUnavailable as exc:
                    await self._outage(exc, stopping, failures)
                    failures += 1
        finally:
            await self.close()

    async def watch(self, stopping: asyncio.Event) -> None:
        """The slot's gauges (retained and unconfirmed WAL, wal_status, safe size, lag) every
        ``GAUGE_SECONDS``, on a connection of their own; a failed look is tried again at the
        next one (the reading loop reports the database's state)."""
        conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        try:
            while not stopping.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self._settings.libpq_dsn,
                            autocommit=True,
                            application_name="outbox-relay-wal-gauges",
                            row_factory=dict_row,
                        )
                    cur = await conn.execute(WAL_SLOT, {"slot": self._settings.wal.slot})
                    row = await cur.fetchone()
                    slot = None if row is None else SlotState(**row)
                    self._metrics.set_wal(WalGauges.of(slot, self._lag()))
                except psycopg.Error as exc:
                    log.debug("slot gauges not read: %r", exc)
                    if conn is not None:
                        with contextlib.suppress(psycopg.Error):
                            await conn.close()
                    conn = None
                await sleep_unless(stopping, GAUGE_SECONDS)
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

    def _lag(self) -> float | None:
        """Seconds since the oldest transaction read and not confirmed committed; 0 when
        the reader is caught up; None (unknown) on a standby."""
        if not self.reading:
            return None
        return 0.0 if self._oldest is None else max(0.0, time.time() - self._oldest)

    @property
    def _heartbeat_prefix(self) -> str:
        return f"{self._settings.wal.prefix}.heartbeat"

    async def _outage(self, exc: BaseException, stopping: asyncio.Event, failures: int) -> None:
        # A lost connection took the reader lock with it: another relay may read now.
        self.database.failed(unavailable(exc))
        self._metrics.errors.labels(type(exc).__name__).inc()
        await self.close()
        await sleep_unless(stopping, self._db_retry.backoff(failures))

    async def close(self) -> None:
        conns = [self._conn, self._side]
        self._conn = self._side = None
        if self.reading:
            log.info("stopped reading the slot", extra={"slot": self._settings.wal.slot})
        self.reading = False
        for conn in conns:
            if conn is not None and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

    def _slot_gone(self, exc: psycopg.Error) -> None:
        """Raise :class:`SlotLost` when ``exc`` says the slot went away under a reader."""
        sqlstate = exc.sqlstate or ""
        if not self.reading or sqlstate not in (_DROPPED, _INVALID):
            return
        message = exc.diag.message_primary or str(exc)
        if "replication slot" not in message:
            return
        since = lsn_text(self.confirmed) if self.confirmed is not None else None
        raise SlotLost(self._settings.wal.slot, since, f"{message} [SQLSTATE {sqlstate}]")

    async def _take_slot(self, stopping: asyncio.Event) -> None:
        """Become the reader, or stand by for one poll interval."""
        conn = self._conn
        assert conn is not None
        slot = self._settings.wal.slot
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(WAL_SLOT, {"slot": slot})
            row = await cur.fetchone()
        if row is None:
            if self.confirmed is not None:
                # This process read the slot before (it went away while the reader was
                # reconnecting): the events past what it confirmed may be gone.
                since = lsn_text(self.confirmed)
                raise SlotLost(slot, since, "dropped while the relay was reconnecting")
            raise SlotMissing(slot)
        state = SlotState(**row)
        why = state.mismatch(conn.info.dbname)
        if why is not None:
            raise WalSlotMismatch(
                f"replication slot {slot!r} {why}: name another one in OUTBOX_WAL__SLOT, "
                "or drop it and run `outbox wal setup`"
            )
        confirmed = state.confirmed_flush_lsn
        if state.wal_status == "lost":
            raise SlotLost(slot, confirmed, "invalidated: wal_status is 'lost'")
        got = await (await conn.execute(self._store.try_lock)).fetchone()
        if not (got and got[0]):
            await sleep_unless(stopping, self._settings.relay.poll_interval_seconds)
            return
        self.reading = True
        self.confirmed = lsn_int(confirmed) if confirmed else None
        log.info("reading the slot", extra={"slot": slot, "confirmed_lsn": confirmed})

    async def _read(self, stopping: asyncio.Event) -> bool:
        """One read of the slot, published and confirmed; True when it held any event."""
        conn = self._conn
        assert conn is not None
        s = self._settings
        loop = asyncio.get_running_loop()
        streams = [_Stream() for _ in range(self._streams)]
        prefix, batch_size = s.wal.prefix, s.relay.batch_size
        events = since_checkpoint = 0
        checked_at = loop.time()
        ce_time = ""
        begin: pgoutput.Begin | None = None  # of the transaction being read
        gated = False  # its events may go before the table's unpublished rows
        safe: int | None = None  # the furthest transaction end read (settled once flushed)
        checkpoints: list[asyncio.Task[None]] = []
        self._cut = False
        try:
            async with conn.transaction():
                cur = conn.cursor("outbox_wal_read", binary=True)
                await cur.execute(self._store.peek, {"slot": s.wal.slot, "n": s.wal.batch_changes})
                # The first fetch is small: its records' size sets the next ones'.
                started = loop.time()
                records = await cur.fetchmany(FIRST_FETCH)
                peeked = loop.time()
                held = False
                while records and not held and not stopping.is_set():
                    for (data,) in records:
                        kind = data[0]
                        if kind == pgoutput.MESSAGE:
                            msg = pgoutput.message(data)
                            if msg.prefix != prefix or not msg.transactional:
                                continue
                            if not gated:
                                # Older table rows first: this read ends before this
                                # transaction (nothing of it is taken yet), the next
                                # one starts from it. Heartbeats are not held.
                                assert begin is not None  # transactional: after its Begin
                                if not await self._gate.allows(begin.moment):
                                    held = True
                                    break
                                gated = True
                            for event in self._events(msg):
                                key = event.key
                                stream = streams[hash(key) % len(streams) if key else 0]
                                stream.rows.append(_row(event, ce_time))
                                stream.bytes += len(event.payload or b"")
                                events += 1
                                if (
                                    len(stream.rows) >= batch_size
                                    or stream.bytes >= self._batch_bytes
                                ):
                                    await self._hand_over(stream, stopping)
                        elif kind == pgoutput.BEGIN:
                            begin = pgoutput.begin(data)
                            gated = False
                            ce_time = begin.commit_time
                            if self._oldest is None:
                                self._oldest = begin.committed_at
                        elif kind == pgoutput.COMMIT:
                            safe = pgoutput.commit(data).end_lsn
                            now = self._last_commit_at = loop.time()
                            if events > since_checkpoint and now - checked_at >= CHECKPOINT_SECONDS:
                                checkpoints.append(await self._checkpoint(streams, safe, stopping))
                                since_checkpoint, checked_at = events, now
                    if held:
                        break
                    # Fewer records per fetch when they are large: a fetch holds about one
                    # batch's worth of bytes at most (a message may carry up to 256 KiB).
                    size = sum(len(r[0]) for r in records)
                    fetch = max(1, min(FETCH_RECORDS, self._batch_bytes * len(records) // size))
                    records = await cur.fetchmany(fetch)
                await self._flush(streams, stopping)
                await cur.close()
            await asyncio.gather(*checkpoints)
        finally:
            # An error or a cancel: nothing left running.
            for task in [*checkpoints, *(st.sending for st in streams if st.sending)]:
                task.cancel()
        read = loop.time()
        await self._advance(conn, safe)
        if not self._cut:
            self._oldest = None  # caught up with what the read held
        if events:
            log.debug(
                "read %d events in %.3f s (decoding until the first record %.3f s, advance %.3f s)",
                events,
                read - started,
                peeked - started,
                loop.time() - read,
            )
        return events > 0

    @staticmethod
    def _events(msg: pgoutput.Message) -> Iterator[wal_codec.WalEvent]:
        """The events of an outbox message; one that cannot be read stops the relay with
        where it is (the slot stays before it: skipping it would lose its events)."""
        try:
            yield from wal_codec.decode(msg.content)
        except wal_codec.WalMessageInvalid as exc:
            raise wal_codec.WalMessageInvalid(
                f"{exc} (message at LSN {lsn_text(msg.lsn)}; to skip it and lose what it "
                "carries, advance the slot past its transaction with "
                "pg_replication_slot_advance)"
            ) from None

    async def _hand_over(self, stream: _Stream, stopping: asyncio.Event) -> None:
        """Publish ``stream``'s filled batch once its previous one is settled."""
        await stream.settled()
        rows, stream.rows, stream.bytes = stream.rows, [], 0
        stream.sending = asyncio.ensure_future(self._settle(rows, stopping))
        stream.sending.add_done_callback(_observed)

    async def _flush(self, streams: list[_Stream], stopping: asyncio.Event) -> None:
        for stream in streams:
            if stream.rows:
                await self._hand_over(stream, stopping)
        for stream in streams:
            await stream.settled()

    async def _checkpoint(
        self, streams: list[_Stream], lsn: int, stopping: asyncio.Event
    ) -> asyncio.Task[None]:
        """Within a large read, confirm ``lsn`` in the background once every event read
        before it is settled (so a crash re-sends less), without holding up the read:
        every stream's events so far are handed over, and the advance waits for the last
        batch of each (a stream's batches settle in order) on the side connection."""
        for stream in streams:
            if stream.rows:
                await self._hand_over(stream, stopping)
        last = [st.sending for st in streams if st.sending is not None]

        async def advance() -> None:
            await asyncio.gather(*last)
            await self._advance(await self._side_conn(), lsn)

        task = asyncio.ensure_future(advance())
        task.add_done_callback(_observed)
        return task

    async def _advance(
        self, conn: psycopg.AsyncConnection[tuple[Any, ...]], lsn: int | None
    ) -> None:
        """Confirm ``lsn`` (everything before it is settled), unless stopping cut a
        publish short: then nothing more is confirmed and the next reader sends the rest."""
        if lsn is None or self._cut or (self.confirmed is not None and lsn <= self.confirmed):
            return
        await conn.execute(
            self._store.advance, {"slot": self._settings.wal.slot, "lsn": lsn_text(lsn)}
        )
        self.confirmed = max(lsn, self.confirmed or 0)

    async def _settle(self, rows: list[ClaimedRow], stopping: asyncio.Event) -> None:
        """Publish ``rows`` until every event is acknowledged or moved to the failed table
        (committed before the slot can move past it); with ``stopping`` set it may give up
        early (nothing is confirmed then)."""
        todo = list(range(len(rows)))
        alone = False
        while todo:
            if stopping.is_set():
                self._cut = True
                return
            sent = [rows[i] for i in todo]
            failed = await self._send(sent, alone)
            retry: list[int] = []
            dead: list[tuple[ClaimedRow, int, str]] = []
            delay = 0.0
            for j, exc in sorted(failed.items()):
                row = sent[j]
                if isinstance(exc, RecordRejected):
                    # Kafka refuses a whole record batch for one record too large for the
                    # topic: from now on each is tried alone, so only that one fails.
                    alone = True
                    attempts = self._attempts.get(row[CE_ID], 0) + 1
                    self._attempts[row[CE_ID]] = attempts
                    if attempts >= self._row_retry.max_attempts:
                        dead.append((row, attempts, str(exc)))
                        continue
                    delay = max(delay, self._row_retry.backoff(attempts))
                elif isinstance(exc, TopicMissing):
                    self._publisher.topic_missing(row[TOPIC], MISSING_TOPIC_RECHECK_SECONDS)
                    delay = max(delay, MISSING_TOPIC_RECHECK_SECONDS)
                elif isinstance(exc, PartitionUnavailable):
                    delay = max(delay, exc.delay)
                elif not isinstance(exc, ProducerBroken):
                    delay = max(delay, self._kafka.backoff())
                retry.append(todo[j])
            if dead:
                await self._move_to_failed(dead)
            todo = retry
            if todo:
                await sleep_unless(stopping, delay)
        if self._attempts:
            for row in rows:
                self._attempts.pop(row[CE_ID], None)

    async def _send(self, rows: list[ClaimedRow], alone: bool) -> dict[int, Exception]:
        """Publish ``rows`` (in one call, or one by one in order); what failed, by index."""
        loop = asyncio.get_running_loop()
        if not alone:
            started = loop.time()
            outcome = await self._publisher.publish(rows, started)
            self._record(outcome, len(rows), loop.time() - started)
            return outcome.failed
        failed: dict[int, Exception] = {}
        for j, row in enumerate(rows):
            started = loop.time()
            outcome = await self._publisher.publish([row], started)
            self._record(outcome, 1, loop.time() - started)
            if outcome.failed:
                failed[j] = exc = outcome.failed[0]
                if not isinstance(exc, RecordRejected):
                    # Kafka's trouble, not the record's: nothing after it may go first.
                    failed.update(dict.fromkeys(range(j + 1, len(rows)), exc))
                    break
        return failed

    def _record(self, outcome: Outcome, rows: int, seconds: float) -> None:
        # Not quiet: a stalled partition's rows wait in place here (the read waits for
        # them), so only a publish that failed as a whole says Kafka is down.
        self._kafka.record(outcome, rows, seconds, self._metrics, quiet=False)

    async def _side_conn(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        """The autocommit connection of the table check and the failed table: a failed
        event is committed there before the slot may move past it."""
        if self._side is None or self._side.closed:
            self._side = await unprepared_connection(self._settings, "outbox-relay-wal-side")
        return self._side

    async def _move_to_failed(self, dead: list[tuple[ClaimedRow, int, str]]) -> None:
        conn = await self._side_conn()
        cur = await conn.execute(self._store.new_ids, {"n": len(dead)})
        ids = [int(r[0]) for r in await cur.fetchall()]
        lanes = self._settings.lanes
        rows = []
        for new_id, (row, _, _) in zip(ids, dead, strict=True):
            full = list(row)
            full[0] = new_id
            key = row[KEY]
            full[1] = envelope.lane_for(key, uuid.UUID(row[CE_ID]), lanes)
            full[-1] = envelope.fingerprint(row[TOPIC], key, row[EVENT_TYPE], row[PAYLOAD])
            rows.append(tuple(full))
        store = self._relay_store
        for params in store.restore_chunks(
            rows, [d[1] for d in dead], [d[2] for d in dead], [0.0] * len(dead)
        ):
            await conn.execute(store.move_to_failed, params)
        report_moved(dead, self._metrics)

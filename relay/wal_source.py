"""The relay's WAL source: events read from a logical replication slot, in commit order.

One relay reads a slot at a time: it holds a session advisory lock (relay/wal_store.py)
on its SQL connection, and the slot itself admits one streaming session (a second
``START_REPLICATION`` fails with SQLSTATE 55006); the others stand by, trying the lock
every ``relay.poll_interval_seconds``, and the first to get it after the reader's
connections die takes over from the slot's confirmed position.

The reader streams the slot over the replication protocol (relay/wal_stream.py):
transactions arrive as they commit, decoded once. Their events are split by key over
``relay.pipelines`` streams; each stream publishes batch after batch (up to
``relay.batch_size`` events or its share of ``relay.max_inflight_bytes``), each waited for
until Kafka has acknowledged every event in it (or refused it for good: the failed table),
so a key's events go out in commit order while one stream's batch waits for acks and the
next fills. A batch goes when it is full, or as soon as the stream has nothing more
buffered and the stream's previous batch is settled: low latency at a trickle, large
batches under load, and at most two batches per stream in memory, however large a
transaction.

Positions the slot may confirm (a transaction's end; a keepalive's WAL end between
transactions) are marked with how many batches of each stream must be settled first;
a mark is confirmed to the server (a standby status update) once they are, never before —
a crash re-reads from the confirmed position (duplicates, never loss: the inbox dedupes).

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
from collections import deque
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import dict_row

from outbox import envelope, pgoutput, wal_codec
from outbox.db import unavailable, unprepared_connection
from outbox.dberrors import is_transient
from outbox.errors import (
    DatabaseUnavailable,
    SchemaMissing,
    TopicMissing,
    WalPrivilegeMissing,
    WalSlotMismatch,
)
from outbox.ops.store import WAL_MAY_REPLICATE, WAL_SLOT
from outbox.ops.wal_health import WalGauges
from outbox.ops.wal_slot import SlotState, setup_sql
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
from relay.wal_held import WHOLE_TOPIC, HeldPartitions
from relay.wal_store import WalStore, lsn_int, lsn_text
from relay.wal_stream import WalStream

log = logging.getLogger("relay.wal")

# Longest wait between two standby status updates (the server ends a replication
# session it has not heard from for wal_sender_timeout, 60 s by default).
STATUS_SECONDS = 10.0
# While transactions keep coming, a position to confirm is marked at a transaction end
# this often at least (and every ``wal.batch_changes`` records).
MARK_SECONDS = 0.05
# How often the slot's gauges are read.
GAUGE_SECONDS = 5.0
# How long rows of a missing topic wait before the topic is asked for again.
MISSING_TOPIC_RECHECK_SECONDS = 5.0
# SQLSTATEs of a slot gone under the reader: dropped (undefined_object), invalidated
# (object_not_in_prerequisite_state: "This slot has been invalidated because it exceeded
# the maximum reserved size").
_DROPPED, _INVALID = "42704", "55000"


def _unreadable(exc: wal_codec.WalMessageInvalid, lsn: int) -> wal_codec.WalMessageInvalid:
    """An outbox message that cannot be read stops the relay with where it is (the slot
    stays before it: skipping it would lose its events)."""
    return wal_codec.WalMessageInvalid(
        f"{exc} (message at LSN {lsn_text(lsn)}; to skip it and lose what it carries, "
        "advance the slot past its transaction with pg_replication_slot_advance)"
    )


def _observed(task: asyncio.Task[None]) -> None:
    """A batch's failure is raised where the stream is waited for; one cancelled after a
    failure elsewhere is read here, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Stream:
    """One key-disjoint share of the slot's events: the batch being filled, and the one
    being published (at most one at a time, so the stream's events stay in order)."""

    def __init__(self) -> None:
        self.rows: list[ClaimedRow] = []
        self.bytes = 0
        self.sending: asyncio.Task[None] | None = None
        self.handed = 0  # batches handed over to publish
        self.done = 0  # of those, settled (acknowledged or moved to failed), in order
        # Settled out of order: a batch whose events wait for a held partition
        # (relay/wal_held.py) settles after the batches published after it.
        self._later: set[int] = set()

    @property
    def free(self) -> bool:
        return self.sending is None or self.sending.done()

    def settle(self, number: int) -> None:
        """Batch ``number`` is settled; ``done`` counts those settled with every one
        before them (a batch given up on stopping is never settled: the count stays)."""
        self._later.add(number)
        while self.done + 1 in self._later:
            self.done += 1
            self._later.discard(self.done)

    async def settled(self) -> None:
        """Until the batch being published is settled (its failure raised here)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            await sending


class _Mark(NamedTuple):
    """A position the slot may confirm once every stream has settled ``needs[i]`` batches
    (those holding every event read before it)."""

    lsn: int
    needs: tuple[int, ...]
    oldest: float | None  # commit time (Unix) of the first transaction since the last mark


class _TableFirst(Exception):
    """The outbox table holds unpublished rows older than the transaction just read."""


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
        self._checked_role = False  # the role's REPLICATION attribute was looked at
        self._slot_busy = False  # START_REPLICATION met another session on the slot
        self._failures = 0  # database failures in a row
        self._wake: asyncio.Future[None] | None = None  # the read loop's idle wait
        # Switching between the sources: table rows older than a transaction go first.
        self._gate = TableGate(self._store.table_oldest, self._side_conn)
        # Commit time (Unix) of the oldest transaction read but not confirmed yet, if any.
        self._oldest: float | None = None
        self._stopping = asyncio.Event()  # run()'s
        # Events of partitions Kafka does not answer for, while the others flow.
        self._held = HeldPartitions(
            self._settle_in_place, r.max_inflight_bytes, r.batch_size, self._nudge, metrics.wal_held
        )

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def run(self, stopping: asyncio.Event) -> None:
        self._stopping = stopping
        loop = asyncio.get_running_loop()
        self._last_commit_at = loop.time()
        try:
            while not stopping.is_set():
                try:
                    if self._conn is None:
                        self._conn = await unprepared_connection(self._settings, "outbox-relay-wal")
                    if not self.reading:
                        await self._take_slot(stopping)
                        continue
                    if not await self._read(stopping):
                        await sleep_unless(stopping, self._settings.relay.poll_interval_seconds)
                except psycopg.errors.UndefinedTable as exc:
                    raise SchemaMissing(
                        f"relay table missing ({exc.diag.message_primary})"
                    ) from None
                except psycopg.Error as exc:
                    self._slot_gone(exc)
                    if not is_transient(exc):
                        raise unavailable(exc) from None
                    await self._outage(exc, stopping)
                except DatabaseUnavailable as exc:
                    await self._outage(exc, stopping)
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

    async def _outage(self, exc: BaseException, stopping: asyncio.Event) -> None:
        # A lost connection took the reader lock with it: another relay may read now.
        self.database.failed(unavailable(exc))
        self._metrics.errors.labels(type(exc).__name__).inc()
        await self.close()
        await sleep_unless(stopping, self._db_retry.backoff(self._failures))
        self._failures += 1

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
        if not self._checked_role:
            await self._check_role(conn)
        got = await (await conn.execute(self._store.try_lock)).fetchone()
        if not (got and got[0]):
            await sleep_unless(stopping, self._settings.relay.poll_interval_seconds)
            return
        self.reading = True
        self.confirmed = lsn_int(confirmed) if confirmed else None
        log.info("reading the slot", extra={"slot": slot, "confirmed_lsn": confirmed})

    async def _check_role(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        """A role without REPLICATION cannot stream the slot: stop with the SQL to run."""
        row = await (await conn.execute(WAL_MAY_REPLICATE)).fetchone()
        if row is not None and not row[0]:
            user = str(row[1])
            raise WalPrivilegeMissing(
                f"role {user} may not read replication slot {self._settings.wal.slot!r} (it "
                f'needs REPLICATION): an administrator runs ALTER ROLE "{user}" WITH '
                "REPLICATION; (all the set-up: `outbox wal setup --print-sql --role "
                f"{user}`)",
                sql=setup_sql(self._settings, conn.info.dbname, user),
                sqlstate="42501",
            )
        self._checked_role = True

    async def _read(self, stopping: asyncio.Event) -> bool:
        """Stream the slot until stopping; False when it stopped for the outbox table
        (unpublished rows go first: the caller waits a poll interval) or another session
        streams the slot (its reader is going away: a standby's turn comes within
        seconds)."""
        s = self._settings
        try:
            ws = await WalStream.start(
                s, s.wal.slot, s.wal.publication, lsn_text(self.confirmed or 0)
            )
        except psycopg.errors.ObjectInUse as exc:
            # Another session streams it: the last reader's, on its way out (a standby
            # that just took over), or something else; said once until streaming starts.
            if not self._slot_busy:
                self._slot_busy = True
                log.info(
                    "the slot is streamed by another session; waiting for it to end: %s",
                    exc.diag.message_primary or exc,
                )
            return False
        self._slot_busy = False
        self._failures = 0
        self.database.ok()
        streams = [_Stream() for _ in range(self._streams)]
        marks: deque[_Mark] = deque()
        try:
            await self._stream(ws, streams, marks, stopping)
            return True
        except _TableFirst:
            # Publish and confirm what came before the transaction that must wait: the
            # next stream starts right after it.
            for stream in streams:
                if stream.rows:
                    await self._hand_over(stream, stopping, ws, streams, marks)
            return False
        finally:
            # Stopping, an error or waiting for the table: what is in flight finishes (or
            # is given up on stopping), what it settled is confirmed, the rest is read
            # again by the next stream (duplicates at worst, never loss).
            try:
                pending = [st.sending for st in streams if st.sending is not None]
                if pending:
                    await asyncio.wait(pending)
                with contextlib.suppress(psycopg.Error):  # the stream may be the failure
                    self._confirm(ws, streams, marks, force=True)
            finally:
                for stream in streams:
                    if stream.sending is not None:
                        stream.sending.cancel()
                await self._held.close()
                await ws.close()

    async def _stream(
        self,
        ws: WalStream,
        streams: list[_Stream],
        marks: deque[_Mark],
        stopping: asyncio.Event,
    ) -> None:
        s = self._settings
        loop = asyncio.get_running_loop()
        prefix, batch_size, batch_bytes = s.wal.prefix, s.relay.batch_size, self._batch_bytes
        mark_every = s.wal.batch_changes
        n_streams = len(streams)
        begin_kind, message_kind, commit_kind = pgoutput.BEGIN, pgoutput.MESSAGE, pgoutput.COMMIT
        safe = marked = self.confirmed or 0  # the furthest confirmable position read
        in_txn = False
        ce_time = ""
        records = 0  # since the last mark
        oldest: float | None = None  # first transaction since the last mark
        marked_at = loop.time()
        begin: pgoutput.Begin | None = None  # of the transaction being read
        gated = False  # its events may go before the table's unpublished rows
        stop_wait = asyncio.ensure_future(stopping.wait())
        stop_wait.add_done_callback(lambda _: self._nudge())
        try:
            while not stopping.is_set():
                item = ws.take()
                if item is None:
                    # Nothing more buffered: free streams publish what they hold, and
                    # what is read so far gets a mark.
                    self._held.check()
                    for stream in streams:
                        if stream.free:
                            await stream.settled()  # a batch that failed raises here
                            if stream.rows:
                                await self._hand_over(stream, stopping, ws, streams, marks)
                    if safe > marked:
                        marks.append(_Mark(safe, self._needs(streams), oldest))
                        marked, records, oldest = safe, 0, None
                        marked_at = loop.time()
                    self._confirm(ws, streams, marks)
                    if loop.time() - self._last_commit_at >= s.wal.heartbeat_seconds:
                        await self._heartbeat()
                    self._wake = loop.create_future()
                    await ws.wait(self._wake, STATUS_SECONDS / 2)
                    continue
                if isinstance(item, int):  # a keepalive: every record before it was sent
                    if not in_txn and item > safe:
                        safe = item
                    continue
                records += 1
                kind = item[0]
                if kind == message_kind:
                    msg = pgoutput.message(item)
                    if msg.prefix != prefix or not msg.transactional:
                        continue
                    if not gated:
                        # Older table rows first (relay/table_gate.py); nothing of this
                        # transaction is taken yet. Heartbeats are not held.
                        assert begin is not None  # transactional: after its Begin
                        if not await self._gate.allows(begin.moment):
                            raise _TableFirst
                        gated = True
                    try:
                        for (
                            event_id,
                            topic,
                            key,
                            event_type,
                            source,
                            content_type,
                            payload,
                            headers,
                        ) in wal_codec.decode(msg.content):
                            stream = streams[hash(key) % n_streams if key else 0]
                            # The claimed-row layout the publisher takes (relay/store.py);
                            # id, lane, attempts and fingerprint only matter if it goes to
                            # the failed table (set then).
                            stream.rows.append(
                                (
                                    0,
                                    0,
                                    topic,
                                    key,
                                    payload,
                                    event_id,
                                    event_type,
                                    source,
                                    content_type,
                                    headers,
                                    ce_time,
                                    0,
                                    b"",
                                )
                            )
                            if payload is not None:
                                stream.bytes += len(payload)
                            if len(stream.rows) >= batch_size or stream.bytes >= batch_bytes:
                                await self._hand_over(stream, stopping, ws, streams, marks)
                    except wal_codec.WalMessageInvalid as exc:
                        raise _unreadable(exc, msg.lsn) from None
                elif kind == begin_kind:
                    begin = pgoutput.begin(item)
                    in_txn, gated = True, False
                    ce_time = begin.commit_time
                    if oldest is None:
                        oldest = begin.committed_at
                    if self._oldest is None:
                        self._oldest = begin.committed_at
                elif kind == commit_kind:
                    safe = pgoutput.commit(item).end_lsn
                    in_txn = False
                    now = self._last_commit_at = loop.time()
                    if records >= mark_every or now - marked_at >= MARK_SECONDS:
                        # A stream that keeps coming seldom leaves the buffer empty.
                        marks.append(_Mark(safe, self._needs(streams), oldest))
                        marked, records, oldest, marked_at = safe, 0, None, now
                        self._confirm(ws, streams, marks)
        finally:
            stop_wait.cancel()
            if safe > marked:  # confirmed once settled (by _read, before the stream ends)
                marks.append(_Mark(safe, self._needs(streams), oldest))

    @staticmethod
    def _needs(streams: list[_Stream]) -> tuple[int, ...]:
        """Per stream, the batches to settle before what was read so far is: those
        handed over, and the one filling."""
        return tuple(st.handed + (1 if st.rows else 0) for st in streams)

    def _nudge(self) -> None:
        """Wake the read loop's idle wait: a batch settled, or stopping."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _confirm(
        self, ws: WalStream, streams: list[_Stream], marks: deque[_Mark], force: bool = False
    ) -> None:
        """Confirm the furthest mark whose batches are all settled; a status update goes
        to the server when the position moved, when it asked for one, or now and then."""
        lsn = None
        while marks and all(st.done >= n for st, n in zip(streams, marks[0].needs, strict=True)):
            lsn = marks.popleft().lsn
        if lsn is not None and lsn > (self.confirmed or 0):
            self.confirmed = lsn
            self._oldest = marks[0].oldest if marks else None
            ws.confirm(lsn)
        elif force or ws.reply_requested or time.monotonic() - ws.sent_at >= STATUS_SECONDS:
            ws.confirm(self.confirmed or 0)

    async def _heartbeat(self) -> None:
        """A transactional message in a transaction of its own, on the SQL connection: its
        commit comes through the stream as a position to confirm (an idle slot moves)."""
        assert self._conn is not None
        await self._conn.execute(self._store.heartbeat, {"prefix": self._heartbeat_prefix})
        self._last_commit_at = asyncio.get_running_loop().time()

    async def _hand_over(
        self,
        stream: _Stream,
        stopping: asyncio.Event,
        ws: WalStream,
        streams: list[_Stream],
        marks: deque[_Mark],
    ) -> None:
        """Publish ``stream``'s filled batch once its previous one is settled, confirming
        what is settled meanwhile (and answering the server: Kafka may take long)."""
        while not stream.free:
            assert stream.sending is not None
            await asyncio.wait([stream.sending], timeout=STATUS_SECONDS / 2)
            self._held.check()
            self._confirm(ws, streams, marks)
        await stream.settled()
        rows, stream.rows, stream.bytes = stream.rows, [], 0
        stream.handed += 1
        stream.sending = asyncio.ensure_future(
            self._settle_batch(stream, stream.handed, rows, stopping)
        )
        stream.sending.add_done_callback(_observed)

    async def _settle_batch(
        self, stream: _Stream, number: int, rows: list[ClaimedRow], stopping: asyncio.Event
    ) -> None:
        """Settle the stream's batch ``number``: at once, or, when some of its events are
        held for an unavailable partition, once they are delivered."""
        try:
            held: list[asyncio.Future[Any]] = []
            if not await self._settle(rows, stopping, held):
                return
            if not held:
                stream.settle(number)
                return
            await self._held.room(stopping)  # held events stay within the memory bound

            def settled(future: asyncio.Future[Any]) -> None:
                if not future.cancelled() and future.exception() is None:
                    stream.settle(number)
                self._nudge()

            asyncio.gather(*held).add_done_callback(settled)
        finally:
            self._nudge()

    async def _settle_in_place(self, rows: list[ClaimedRow]) -> bool:
        """A held partition's events: retried in place, in order, until settled."""
        return await self._settle(rows, self._stopping, None)

    async def _settle(
        self,
        rows: list[ClaimedRow],
        stopping: asyncio.Event,
        held: list[asyncio.Future[Any]] | None,
    ) -> bool:
        """Publish ``rows`` until every event is acknowledged or moved to the failed table
        (committed before the slot can move past it); with ``stopping`` set it may give up
        early (False: nothing is confirmed then). With ``held`` (a list), events of an
        unavailable partition are held instead (relay/wal_held.py): the futures that say
        when they are settled are added to it."""
        todo = list(range(len(rows)))
        if held is not None and self._held:
            # A held partition's later events queue behind it (per-key order).
            routed: dict[tuple[str, int], list[ClaimedRow]] = {}
            direct = []
            for i in todo:
                tp = self._held.route(rows[i])
                if tp is None:
                    direct.append(i)
                else:
                    routed.setdefault(tp, []).append(rows[i])
            held.extend(self._held.hold(tp, queued, None) for tp, queued in routed.items())
            todo = direct
        alone = False
        while todo:
            if stopping.is_set():
                return False
            sent = [rows[i] for i in todo]
            failed = await self._send(sent, alone)
            retry: list[int] = []
            dead: list[tuple[ClaimedRow, int, str]] = []
            to_hold: dict[tuple[str, int], list[ClaimedRow]] = {}
            delay = 0.0
            for j, exc in sorted(failed.items()):
                row = sent[j]
                if held is not None:
                    tp = self._to_hold(row, exc)
                    if tp is not None:
                        to_hold.setdefault(tp, []).append(row)
                        continue
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
            if held is not None:
                held.extend(
                    self._held.hold(tp, queued, self._partitions(tp[0]))
                    for tp, queued in to_hold.items()
                )
            todo = retry
            if todo:
                await sleep_unless(stopping, delay)
        if self._attempts:
            for row in rows:
                self._attempts.pop(row[CE_ID], None)
        return True

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

    def _to_hold(self, row: ClaimedRow, exc: Exception) -> tuple[str, int] | None:
        """The queue ``row`` goes to, refused with ``exc``, if it is held (relay/wal_held.py):
        its partition's when Kafka does not answer for it, its topic's when the topic does
        not exist. (A one-by-one publish refuses every row after a refusal with it: those of
        other partitions or topics are retried in place.)"""
        if isinstance(exc, PartitionUnavailable):
            if self._held.may_hold(row, exc.tp, self._partitions(exc.tp[0])):
                return exc.tp
        elif isinstance(exc, TopicMissing) and row[TOPIC] == exc.topic:
            return exc.topic, WHOLE_TOPIC
        return None

    def _partitions(self, topic: str) -> list[int] | None:
        """``topic``'s partitions as the publisher last planned them."""
        return self._publisher.planner.partitions.get(topic)

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

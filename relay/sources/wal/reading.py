"""Reading the slot: one ``START_REPLICATION`` streamed over the replication protocol
(relay/sources/wal/stream.py), transactions arriving as they commit, decoded once.

Their events are split by key over ``relay.pipelines`` streams; each stream publishes batch
after batch (up to ``relay.batch_size`` events or its share of ``relay.max_inflight_bytes``),
each waited for until Kafka has acknowledged every event in it (or refused it for good: the
failed table; relay/sources/wal/settling.py), so a key's events go out in commit order while
one stream's batch waits for acks and the next fills. A batch goes when it is full, or as
soon as the stream has nothing more buffered and the stream's previous batch is settled: low
latency at a trickle, large batches under load, and at most two batches per stream in
memory, however large a transaction.

Positions the slot may confirm (a transaction's end; a keepalive's WAL end between
transactions) are marked with how many batches of each stream must be settled first; a mark
is confirmed to the server (a standby status update) once they are, never before — a crash
re-reads from the confirmed position (duplicates, never loss: the inbox dedupes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime

import psycopg

from outbox import pgoutput, wal_codec
from outbox.settings import RelaySettings, WalSettings
from relay.database import Connection
from relay.fence import now as fence_now
from relay.outage import OutageGuard
from relay.sources.wal.gate import TableGate
from relay.sources.wal.settling import Settler
from relay.sources.wal.slot import ReaderLock
from relay.sources.wal.store import WalStore, lsn_text
from relay.sources.wal.stream import WalStream
from relay.sources.wal.streams import KeyStream, Mark, Wake, needs, observed
from relay.sources.wal.table_rows import TableRows

log = logging.getLogger("relay.wal")

# Longest wait between two standby status updates (the server ends a replication
# session it has not heard from for wal_sender_timeout, 60 s by default).
STATUS_SECONDS = 10.0
# While transactions keep coming, a position to confirm is marked at a transaction end
# this often at least (and every ``wal.batch_changes`` records).
MARK_SECONDS = 0.05
# How often an idle stream looks at the outbox table for rows due (table_rows.py).
TABLE_LOOK_SECONDS = 2.0


def _unreadable(exc: wal_codec.WalMessageInvalid, lsn: int) -> wal_codec.WalMessageInvalid:
    """A message of an encoding version this relay does not know stops it with where it is
    (the slot stays before it: skipping it would lose its events; a newer relay reads it).
    Any other undecodable message is quarantined instead (Settler.quarantine)."""
    return wal_codec.WalMessageInvalid(
        f"{exc} (message at LSN {lsn_text(lsn)}; to skip it and lose what it carries, "
        "advance the slot past its transaction with pg_replication_slot_advance)"
    )


class _TableFirst(Exception):
    """The outbox table holds unpublished rows older than the transaction just read (or, at
    a heartbeat, rows due): a hold point at that transaction's commit time."""

    def __init__(self, commit_time: datetime) -> None:
        super().__init__(commit_time)
        self.commit_time = commit_time


class Reader:
    """The reading of the slot, by the relay holding the reader lock."""

    def __init__(
        self,
        wal: WalSettings,
        relay: RelaySettings,
        replication: Callable[[str], Awaitable[Connection]],
        store: WalStore,
        lock: ReaderLock,
        settler: Settler,
        gate: TableGate,
        guard: OutageGuard,
        wake: Wake,
        sql: Callable[[], Connection],
        table_rows: TableRows,
    ) -> None:
        self._wal = wal
        self._replication = replication  # opens a named replication connection
        self._store = store
        self._lock = lock
        self._settler = settler
        self._gate = gate
        self._guard = guard
        self._wake = wake
        self._sql = sql  # the reader lock's connection (heartbeats go there)
        self._table_rows = table_rows
        self._table_looked_at = 0.0  # loop time the idle stream last looked for due rows
        self._batch_size = relay.batch_size
        self._streams = max(1, relay.pipelines)
        # Two batches per stream may be around at once (one filling, one in flight).
        self._batch_bytes = max(1, relay.max_inflight_bytes // (2 * self._streams))
        self._slot_busy = False  # START_REPLICATION met another session on the slot
        self._last_commit_at = 0.0  # loop time of the last transaction end read
        # Commit time (Unix) of the oldest transaction read but not confirmed yet, if any.
        self._oldest: float | None = None

    def started(self) -> None:
        """The relay runs: heartbeats count from now."""
        self._last_commit_at = asyncio.get_running_loop().time()

    def lag(self) -> float | None:
        """Seconds since the oldest transaction read and not confirmed committed; 0 when
        the reader is caught up; None (unknown) on a standby."""
        if not self._lock.reading:
            return None
        return 0.0 if self._oldest is None else max(0.0, time.time() - self._oldest)

    @property
    def _heartbeat_prefix(self) -> str:
        return f"{self._wal.prefix}.heartbeat"

    async def read(self, stopping: asyncio.Event) -> bool:
        """Stream the slot until stopping; False when it stopped for the outbox table
        (unpublished rows go first: the caller waits a poll interval, unless this published
        some of them: then True) or another session streams the slot (its reader is going
        away: a standby's turn comes within seconds)."""
        wal = self._wal
        try:
            ws = await WalStream.start(
                self._replication,
                wal.slot,
                wal.publication,
                lsn_text(self._lock.confirmed or 0),
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
        self._guard.ok()
        streams = [KeyStream() for _ in range(self._streams)]
        marks: deque[Mark] = deque()
        hold: datetime | None = None  # the commit time of the transaction the table holds
        held_any = False  # events before it wait for an unavailable partition
        try:
            await self._stream(ws, streams, marks, stopping)
            return True
        except _TableFirst as first:
            # Publish and confirm what came before the transaction that must wait: the
            # next stream starts right after it.
            for stream in streams:
                if stream.rows:
                    await self._hand_over(stream, ws, streams, marks)
            hold = first.commit_time
        finally:
            # Stopping, an error or waiting for the table: what is in flight finishes (or
            # is given up on stopping), what it settled is confirmed, the rest is read
            # again by the next stream (duplicates at worst, never loss).
            held_any = bool(self._settler.held)
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
                await self._settler.held.close()
                await ws.close()
        # A hold point (table_rows.py): the table's rows created up to it go now, but only
        # once every event read before it is settled, none held for a partition (a later
        # row of its key must not pass it).
        assert hold is not None  # only the hold's path comes this far
        if held_any or any(st.done != st.handed for st in streams):
            return False
        return await self._table_rows.publish(hold, stopping) > 0

    async def _stream(
        self,
        ws: WalStream,
        streams: list[KeyStream],
        marks: deque[Mark],
        stopping: asyncio.Event,
    ) -> None:
        loop = asyncio.get_running_loop()
        prefix, batch_size, batch_bytes = self._wal.prefix, self._batch_size, self._batch_bytes
        mark_every, heartbeat = self._wal.batch_changes, self._wal.heartbeat_seconds
        heartbeat_prefix = self._heartbeat_prefix
        n_streams = len(streams)
        begin_kind, message_kind, commit_kind = pgoutput.BEGIN, pgoutput.MESSAGE, pgoutput.COMMIT
        safe = marked = self._lock.confirmed or 0  # the furthest confirmable position read
        in_txn = False
        ce_time = ""
        records = 0  # since the last mark
        oldest: float | None = None  # first transaction since the last mark
        marked_at = loop.time()
        begin: pgoutput.Begin | None = None  # of the transaction being read
        gated = False  # its events may go before the table's unpublished rows
        stop_wait = asyncio.ensure_future(stopping.wait())
        stop_wait.add_done_callback(lambda _: self._wake.nudge())
        try:
            while not stopping.is_set():
                item = ws.take()
                if item is None:
                    # Nothing more buffered: free streams publish what they hold, and
                    # what is read so far gets a mark.
                    self._settler.held.check()
                    for stream in streams:
                        if stream.free:
                            await stream.settled()  # a batch that failed raises here
                            if stream.rows:
                                await self._hand_over(stream, ws, streams, marks)
                    if safe > marked:
                        marks.append(Mark(safe, needs(streams), oldest))
                        marked, records, oldest = safe, 0, None
                        marked_at = loop.time()
                    self._confirm(ws, streams, marks)
                    if loop.time() - self._last_commit_at >= heartbeat:
                        await self._heartbeat()
                    elif await self._table_rows_due(loop.time()):
                        # Its commit, read next, is a hold point for them (table_rows.py).
                        await self._heartbeat()
                    await ws.wait(self._wake.arm(), TABLE_LOOK_SECONDS)
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
                        if msg.prefix == heartbeat_prefix and not gated and msg.transactional:
                            # The relay's heartbeat: a hold point when table rows are due.
                            assert begin is not None
                            # Not while events wait for a partition: the stream would stop
                            # and read them again, and the rows could not go anyway.
                            if not self._settler.held and await self._gate.rows_due(begin.moment):
                                raise _TableFirst(begin.moment)
                            gated = True
                        continue
                    if not gated:
                        # Older table rows first (relay/sources/wal/gate.py); nothing of this
                        # transaction is taken yet (a heartbeat holds only for rows due:
                        # above).
                        assert begin is not None  # transactional: after its Begin
                        if not await self._gate.allows(begin.moment):
                            raise _TableFirst(begin.moment)
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
                            # An event (relay/event.py): its id, lane, attempts and
                            # fingerprint only matter if it goes to the failed table (set
                            # then: Settler._move_to_failed).
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
                                await self._hand_over(stream, ws, streams, marks)
                    except wal_codec.WalVersionUnknown as exc:
                        # A newer producer's encoding: upgrade the relay, skip nothing.
                        raise _unreadable(exc, msg.lsn) from None
                    except wal_codec.WalMessageInvalid as exc:
                        # Events decoded before the fault are on their way; the whole
                        # content is kept (a retry of it duplicates them: the inbox dedupes).
                        content = bytes(msg.content)
                        await self._settler.quarantine(content, msg.lsn, ce_time, str(exc))
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
                    if await self._table_rows_due(now):
                        # A busy stream is never idle: its heartbeat is the hold point.
                        await self._heartbeat()
                    if records >= mark_every or now - marked_at >= MARK_SECONDS:
                        # A stream that keeps coming seldom leaves the buffer empty.
                        marks.append(Mark(safe, needs(streams), oldest))
                        marked, records, oldest, marked_at = safe, 0, None, now
                        self._confirm(ws, streams, marks)
        finally:
            stop_wait.cancel()
            if safe > marked:  # confirmed once settled (by _read, before the stream ends)
                marks.append(Mark(safe, needs(streams), oldest))

    def _confirm(
        self, ws: WalStream, streams: list[KeyStream], marks: deque[Mark], force: bool = False
    ) -> None:
        """Confirm the furthest mark whose batches are all settled; a status update goes
        to the server when the position moved, when it asked for one, or now and then."""
        lsn = None
        while marks and all(st.done >= n for st, n in zip(streams, marks[0].needs, strict=True)):
            lsn = marks.popleft().lsn
        if lsn is not None and lsn > (self._lock.confirmed or 0):
            self._lock.confirmed = lsn
            self._oldest = marks[0].oldest if marks else None
            ws.confirm(lsn)
        elif force or ws.reply_requested or time.monotonic() - ws.sent_at >= STATUS_SECONDS:
            ws.confirm(self._lock.confirmed or 0)

    async def _table_rows_due(self, now: float) -> bool:
        """Every TABLE_LOOK_SECONDS: whether the outbox table has rows due that no WAL
        transaction may come to hold (a stray publish on an idle stream; a row delayed at
        publish, which holds nothing)."""
        if now - self._table_looked_at < TABLE_LOOK_SECONDS or self._settler.held:
            return False
        self._table_looked_at = now
        return await self._gate.rows_due()

    async def _heartbeat(self) -> None:
        """A transactional message in a transaction of its own, on the SQL connection: its
        commit comes through the stream as a position to confirm (an idle slot moves)."""
        sent = fence_now()
        await self._sql().execute(self._store.heartbeat, {"prefix": self._heartbeat_prefix})
        self._lock.fence.answered(sent)
        self._last_commit_at = asyncio.get_running_loop().time()

    async def _hand_over(
        self,
        stream: KeyStream,
        ws: WalStream,
        streams: list[KeyStream],
        marks: deque[Mark],
    ) -> None:
        """Publish ``stream``'s filled batch once its previous one is settled, confirming
        what is settled meanwhile (and answering the server: Kafka may take long)."""
        while not stream.free:
            assert stream.sending is not None
            await asyncio.wait([stream.sending], timeout=STATUS_SECONDS / 2)
            self._settler.held.check()
            self._confirm(ws, streams, marks)
        await stream.settled()
        rows, stream.rows, stream.bytes = stream.rows, [], 0
        stream.handed += 1
        stream.sending = asyncio.ensure_future(
            self._settler.settle_batch(stream, stream.handed, rows)
        )
        stream.sending.add_done_callback(observed)

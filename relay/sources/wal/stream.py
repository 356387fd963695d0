"""A logical replication slot read over the streaming replication protocol (pgoutput).

psycopg 3 has no replication API of its own, so this drives its documented low-level
libpq wrapper (``Connection.pgconn``, :mod:`psycopg.pq`): the connection is opened by
psycopg with ``replication=database`` (libpq does TLS, SCRAM and every other DSN setting),
then ``START_REPLICATION SLOT ... LOGICAL`` puts it in COPY BOTH mode, where the server
sends

    XLogData          'w' int64 start, int64 end, int64 send time, then one pgoutput record
    primary keepalive 'k' int64 WAL end, int64 send time, int8 reply requested

and the client sends standby status updates

    'r' int64 written, int64 flushed, int64 applied, int64 send time, int8 reply requested

whose flushed position is what the slot may confirm (``confirmed_flush_lsn``): the caller
says which one (:meth:`WalStream.confirm`); nothing is confirmed on its own.

Decoding runs once, forward, from the slot's position: unlike the SQL functions, a read
does not decode the WAL again from the slot's restart position. Nothing here blocks the
event loop: records are taken from libpq's buffer without waiting (:meth:`take`), and the
caller awaits :meth:`wait` when the buffer is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import pq

# Opens a replication connection under an application name.
Connect = Callable[[str], Awaitable[psycopg.AsyncConnection[Any]]]

_XLOG, _KEEPALIVE = ord("w"), ord("k")
_XLOG_HEAD = 25  # 'w' + three int64
_KEEPALIVE_BODY = struct.Struct(">qqB")
_STATUS = struct.Struct(">cqqqqB")
_PG_EPOCH_UNIX = 946_684_800  # 2000-01-01 UTC: the protocol's clock starts there


def _error(result: pq.abc.PGresult | None, pgconn: pq.abc.PGconn) -> psycopg.Error:
    """The server's error as psycopg's class for its SQLSTATE (so callers tell a slot in
    use from a slot gone), with its primary message."""
    sqlstate = message = None
    if result is not None:
        raw = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = raw.decode() if raw else None
        primary = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        message = primary.decode(errors="replace") if primary else None
    if message is None:
        message = pgconn.get_error_message() or "replication connection lost"
    cls: type[psycopg.Error] = psycopg.OperationalError
    if sqlstate:
        with contextlib.suppress(KeyError):
            cls = psycopg.errors.lookup(sqlstate)
    # ``info``: the result, so ``exc.diag`` gives its fields as for any statement's error.
    return cls(message, info=result)


def _micros_now() -> int:
    return int((time.time() - _PG_EPOCH_UNIX) * 1_000_000)


class WalStream:
    """One ``START_REPLICATION`` of a slot: :meth:`take` its records, :meth:`confirm`
    positions, :meth:`close` it. Open it with :meth:`start`."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn
        self._pg = conn.pgconn
        self._fd = self._pg.socket
        self.received = 0  # the furthest WAL end the server said it sent
        self.reply_requested = False  # a keepalive asked for a status update
        self._flushed = 0  # the position last sent as flushed
        self.sent_at = 0.0  # monotonic time of the last status update

    @classmethod
    async def start(cls, connect: Connect, slot: str, publication: str, lsn: str) -> WalStream:
        """Stream ``slot`` from ``lsn`` (its confirmed position: the server starts from
        the later of the two), over a replication connection ``connect`` opens (outbox/db.py:
        ``replication_connection``). Errors are psycopg's (SQLSTATE 55006: another session
        streams the slot; 42704: no such slot); a refused connection is
        :class:`~outbox.errors.ReplicationRefused` when no retry can help."""
        conn = await connect("outbox-relay-wal-stream")
        stream = cls(conn)
        try:
            await stream._start(slot, publication, lsn)
        except BaseException:
            await stream.close()
            raise
        return stream

    async def _start(self, slot: str, publication: str, lsn: str) -> None:
        pg = self._pg
        # Names are validated SQL identifiers (outbox/settings.py); quoted all the same.
        command = (
            f'START_REPLICATION SLOT "{slot}" LOGICAL {lsn} ("proto_version" \'1\', '
            f'"publication_names" \'"{publication}"\', "messages" \'true\')'
        )
        pg.nonblocking = 1
        pg.send_query(command.encode())
        while pg.flush():
            await self._ready(write=True)
        while True:
            pg.consume_input()
            if not pg.is_busy():
                break
            await self._ready()
        result = pg.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            raise _error(result, pg)

    async def _ready(self, write: bool = False, within: float | None = None) -> None:
        """Until the socket is readable (writable), or ``within`` seconds passed."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def fire() -> None:
            if not ready.done():
                ready.set_result(None)

        add, remove = loop.add_reader, loop.remove_reader
        if write:
            add, remove = loop.add_writer, loop.remove_writer
        add(self._fd, fire)
        try:
            await asyncio.wait_for(ready, within)
        except TimeoutError:
            pass
        finally:
            remove(self._fd)

    def take(self) -> memoryview | int | None:
        """The next pgoutput record (a memoryview of it), a keepalive's WAL end (an int:
        every record before it was sent), or None when nothing more is buffered (then
        :meth:`wait`). Raises psycopg's error when the server ends the stream."""
        pg = self._pg
        n, data = pg.get_copy_data(1)
        if n == 0:
            pg.consume_input()
            n, data = pg.get_copy_data(1)
            if n == 0:
                return None
        if n < 0:
            raise self._ended()
        kind = data[0]
        if kind == _XLOG:
            return data[_XLOG_HEAD:]
        if kind == _KEEPALIVE:
            end, _, reply = _KEEPALIVE_BODY.unpack_from(data, 1)
            self.received = max(self.received, end)
            if reply:
                self.reply_requested = True
            return int(end)
        return self.take()  # no other message is defined in COPY BOTH: skip it

    def _ended(self) -> psycopg.Error:
        pg = self._pg
        result = pg.get_result()
        # Drain the rest so the connection can be closed cleanly.
        while pg.get_result() is not None:
            pass
        if result is not None and result.status == pq.ExecStatus.COMMAND_OK:
            return psycopg.OperationalError("the server ended the replication stream")
        return _error(result, pg)

    async def wait(self, wake: asyncio.Future[None], within: float) -> None:
        """Until the server sent something, ``wake`` is done or ``within`` seconds passed."""
        loop = asyncio.get_running_loop()
        fd = self._fd

        def fire() -> None:
            if not wake.done():
                wake.set_result(None)

        loop.add_reader(fd, fire)
        try:
            await asyncio.wait_for(asyncio.shield(wake), within)
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)

    def confirm(self, flushed: int) -> None:
        """Send a standby status update: ``flushed`` is the position the slot may confirm
        (never beyond what the caller has settled); it is sent as written and applied
        too. A lower position than the last one sent is sent as the last one."""
        self._flushed = max(self._flushed, flushed)
        lsn = self._flushed
        self.reply_requested = False
        self.sent_at = time.monotonic()
        self._pg.put_copy_data(_STATUS.pack(b"r", lsn, lsn, lsn, _micros_now(), 0))
        self._pg.flush()  # what does not fit in the socket now goes with the next call

    async def close(self, flush_within: float = 1.0) -> None:
        """Close the connection, after sending what is still buffered (the last status
        update) for up to ``flush_within`` seconds."""
        pg = self._pg
        deadline = time.monotonic() + flush_within
        try:
            while pg.status != pq.ConnStatus.BAD and pg.flush():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await self._ready(write=True, within=left)
        except psycopg.Error:
            pass
        await self._conn.close()

"""relay/sources/wal/stream.py's side of the replication protocol, against a fake libpq connection:
what each COPY BOTH message becomes, how the end of a stream is reported, and what a
standby status update carries. (The integration tests stream real slots.)"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import psycopg
import pytest
from psycopg import pq

from relay.sources.wal.stream import WalStream


class _Result:
    def __init__(self, status: pq.ExecStatus, fields: dict[int, bytes] | None = None) -> None:
        self.status = status
        self._fields = fields or {}

    def error_field(self, field: pq.DiagnosticField) -> bytes | None:
        return self._fields.get(int(field))


class _PGconn:
    """What the stream calls on libpq: queued COPY data, results after the end."""

    def __init__(self) -> None:
        self.socket = -1
        self.copy: deque[tuple[int, bytes]] = deque()
        self.results: deque[_Result | None] = deque()
        self.sent: list[bytes] = []
        self.consumed = 0
        self.status = pq.ConnStatus.OK

    def get_copy_data(self, _async: int) -> tuple[int, memoryview]:
        n, data = self.copy.popleft() if self.copy else (0, b"")
        return n, memoryview(data)  # as psycopg's libpq wrapper gives it

    def consume_input(self) -> None:
        self.consumed += 1

    def get_result(self) -> _Result | None:
        return self.results.popleft() if self.results else None

    def get_error_message(self) -> str:
        return "server closed the connection unexpectedly"

    def put_copy_data(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return 1

    def flush(self) -> int:
        return 0


class _Conn:
    def __init__(self) -> None:
        self.pgconn: Any = _PGconn()


def stream() -> tuple[WalStream, _PGconn]:
    conn = _Conn()
    return WalStream(conn), conn.pgconn  # type: ignore[arg-type]


def xlog(payload: bytes, start: int = 0x16B0000, end: int = 0x16B0100) -> tuple[int, bytes]:
    data = b"w" + struct.pack(">qqq", start, end, 0) + payload
    return len(data), data


def keepalive(end: int, reply: bool) -> tuple[int, bytes]:
    data = b"k" + struct.pack(">qqB", end, 0, int(reply))
    return len(data), data


def test_xlogdata_gives_the_pgoutput_record_alone() -> None:
    ws, pg = stream()
    pg.copy.append(xlog(b"B" + b"\x00" * 20))
    record = ws.take()
    assert isinstance(record, memoryview) and bytes(record) == b"B" + b"\x00" * 20


def test_a_keepalive_gives_its_wal_end_and_remembers_a_reply_request() -> None:
    ws, pg = stream()
    pg.copy.extend([keepalive(0x2000, False), keepalive(0x1000, True)])
    assert ws.take() == 0x2000
    assert not ws.reply_requested
    assert ws.take() == 0x1000
    assert ws.reply_requested
    assert ws.received == 0x2000  # the furthest the server said it sent


def test_an_unknown_message_is_skipped() -> None:
    ws, pg = stream()
    pg.copy.extend([(3, b"zzz"), keepalive(0x3000, False)])
    assert ws.take() == 0x3000


def test_nothing_buffered_reads_the_socket_once_then_says_none() -> None:
    ws, pg = stream()
    assert ws.take() is None
    assert pg.consumed == 1


def test_a_stream_the_server_ended_cleanly_is_an_operational_error() -> None:
    ws, pg = stream()
    pg.copy.append((-1, b""))
    pg.results.extend([_Result(pq.ExecStatus.COMMAND_OK), None])
    with pytest.raises(psycopg.OperationalError, match="ended the replication stream"):
        ws.take()


def test_a_server_error_keeps_its_sqlstate_class_and_primary_message() -> None:
    ws, pg = stream()
    pg.copy.append((-1, b""))
    fields = {
        int(pq.DiagnosticField.SQLSTATE): b"55000",
        int(
            pq.DiagnosticField.MESSAGE_PRIMARY
        ): b'can no longer get changes from replication slot "s"',
    }
    pg.results.extend([_Result(pq.ExecStatus.FATAL_ERROR, fields), None])
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as caught:
        ws.take()
    assert "can no longer get changes" in str(caught.value)


def test_a_connection_lost_without_a_result_says_what_libpq_says() -> None:
    ws, pg = stream()
    pg.copy.append((-1, b""))
    with pytest.raises(psycopg.OperationalError, match="closed the connection"):
        ws.take()


def test_a_status_update_never_goes_back() -> None:
    ws, pg = stream()
    ws.reply_requested = True
    ws.confirm(0x5000)
    ws.confirm(0x4000)  # lower: sent as the last one
    assert not ws.reply_requested
    decoded = [struct.unpack(">cqqqqB", m) for m in pg.sent]
    assert [(d[0], d[1], d[2], d[3], d[5]) for d in decoded] == [
        (b"r", 0x5000, 0x5000, 0x5000, 0),
        (b"r", 0x5000, 0x5000, 0x5000, 0),
    ]
    assert all(d[4] > 0 for d in decoded)  # microseconds since 2000-01-01

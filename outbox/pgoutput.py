"""The three pgoutput (protocol version 1) records the WAL source reads: Begin, logical
Message and Commit (``outbox lag`` reads a Begin's commit time too). Every other record
(relations, row changes, types, origins) is skipped: the publication carries no tables,
and a table added to it by hand changes nothing here.

    B  int64 final LSN, int64 commit time (microseconds since 2000-01-01 UTC), int32 xid
    M  int8 flags (1 = transactional), int64 LSN, prefix (NUL-terminated), int32 n, n bytes
    C  int8 flags, int64 commit LSN, int64 end LSN, int64 commit time
"""

from __future__ import annotations

import datetime as dt
import struct
from typing import NamedTuple

from outbox.errors import WalRecordInvalid

BEGIN, MESSAGE, COMMIT = ord("B"), ord("M"), ord("C")
_BEGIN = struct.Struct(">qqi")
_MESSAGE_HEAD = struct.Struct(">Bq")
_COMMIT = struct.Struct(">Bqqq")
_LEN = struct.Struct(">i")
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_PG_EPOCH_UNIX = _PG_EPOCH.timestamp()


class Begin(NamedTuple):
    final_lsn: int  # the commit record's LSN: orders transactions, names one
    commit_time: str  # CloudEvents `time` of its events (ISO 8601, UTC, microseconds)
    committed_at: float  # the same as Unix time (the slot's lag is measured from it)
    micros: int  # the same as PostgreSQL has it: microseconds since 2000-01-01 UTC

    @property
    def moment(self) -> dt.datetime:
        return _PG_EPOCH + dt.timedelta(microseconds=self.micros)


class Message(NamedTuple):
    transactional: bool
    lsn: int
    prefix: str
    content: memoryview


class Commit(NamedTuple):
    end_lsn: int  # a position the slot may be advanced to once the transaction is done


def _time(micros: int) -> str:
    moment = _PG_EPOCH + dt.timedelta(microseconds=micros)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def begin(data: bytes | memoryview) -> Begin:
    try:
        final_lsn, commit_time, _ = _BEGIN.unpack_from(data, 1)
    except struct.error as exc:
        raise WalRecordInvalid(f"pgoutput Begin record: {exc}") from None
    return Begin(final_lsn, _time(commit_time), _PG_EPOCH_UNIX + commit_time / 1e6, commit_time)


def message(data: bytes | memoryview) -> Message:
    """A Message record; its content a memoryview of ``data`` (no copy)."""
    view = memoryview(data)
    at = 1 + _MESSAGE_HEAD.size
    try:
        flags, lsn = _MESSAGE_HEAD.unpack_from(view, 1)
        # The prefix is short: look for its end in a small copy of the head only.
        nul = at + bytes(view[at : at + 256]).index(0)
    except struct.error as exc:
        raise WalRecordInvalid(f"pgoutput Message record: {exc}") from None
    except ValueError:
        try:
            nul = at + bytes(view[at:]).index(0)
        except ValueError as exc:
            raise WalRecordInvalid(f"pgoutput Message record: {exc}") from None
    prefix = bytes(view[at:nul]).decode()
    try:
        (n,) = _LEN.unpack_from(view, nul + 1)
    except struct.error as exc:
        raise WalRecordInvalid(f"pgoutput Message record: {exc}") from None
    start = nul + 1 + _LEN.size
    if start + n != len(view):
        raise WalRecordInvalid(f"pgoutput Message record: {n} content bytes announced")
    return Message(bool(flags & 1), lsn, prefix, view[start:])


def commit(data: bytes | memoryview) -> Commit:
    try:
        _, _, end_lsn, _ = _COMMIT.unpack_from(data, 1)
    except struct.error as exc:
        raise WalRecordInvalid(f"pgoutput Commit record: {exc}") from None
    return Commit(end_lsn)

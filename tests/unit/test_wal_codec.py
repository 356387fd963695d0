"""The WAL message encoding (outbox/wal_codec.py) and the pgoutput records the relay reads
(outbox/pgoutput.py): round trips, and typed errors for what cannot be read."""

from __future__ import annotations

import datetime as dt
import struct
import uuid

import pytest

from outbox import TOMBSTONE, pgoutput, wal_codec
from outbox.envelope import Message, prepare
from outbox.errors import WalRecordInvalid
from outbox.wal_codec import WalEvent, WalMessageInvalid, WalVersionUnknown


def _row(**fields: object) -> object:
    base: dict[str, object] = {
        "topic": "orders",
        "payload": {"id": 1, "note": "é"},
        "event_type": "order.created",
        "key": "k1",
    }
    base.update(fields)
    return prepare(Message(**base), lanes=64, max_bytes=1 << 20, default_source="urn:t")  # type: ignore[arg-type]


def _event(row: object) -> WalEvent:
    r = row
    return WalEvent(
        str(r.event_id),  # type: ignore[attr-defined]
        r.topic,  # type: ignore[attr-defined]
        r.key,  # type: ignore[attr-defined]
        r.event_type,  # type: ignore[attr-defined]
        r.source,  # type: ignore[attr-defined]
        r.content_type,  # type: ignore[attr-defined]
        r.payload,  # type: ignore[attr-defined]
        r.headers,  # type: ignore[attr-defined]
    )


def test_round_trip_of_every_shape_in_one_message() -> None:
    rows = [
        _row(),
        _row(key=None, payload=b"\x00\xffraw"),
        _row(payload=TOMBSTONE, event_type="order.deleted"),
        _row(headers={"traceparent": "00-abc-01", "x": "y"}, sequence=7, source="urn:other"),
        _row(payload=b"", key=b""),
    ]
    content = wal_codec.encode(rows)  # type: ignore[arg-type]
    assert content[0] == wal_codec.VERSION
    assert list(wal_codec.decode(content)) == [_event(r) for r in rows]


def test_encoding_is_compact() -> None:
    row = _row(payload=b"x" * 300)
    overhead = len(wal_codec.encode([row])) - 300  # type: ignore[list-item]
    # version, length, flags, id, type code, topic, event type, source, key
    assert overhead == 1 + 4 + 1 + 16 + 1 + (2 + 6) + (2 + 13) + (2 + 5) + (4 + 2)


def test_no_event_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        wal_codec.encode([])


@pytest.mark.parametrize("cut", [1, 3, 5, 10, 30, 60])
def test_a_truncated_message_is_a_typed_error(cut: int) -> None:
    content = wal_codec.encode([_row(headers={"h": "v"})])  # type: ignore[list-item]
    with pytest.raises(WalMessageInvalid):
        list(wal_codec.decode(content[: len(content) - cut]))


def test_garbled_messages_are_typed_errors() -> None:
    content = bytearray(wal_codec.encode([_row()]))  # type: ignore[list-item]
    bad_type = bytearray(content)
    bad_type[1 + 4 + 1 + 16] = 9  # content type code
    with pytest.raises(WalMessageInvalid, match="content type"):
        list(wal_codec.decode(bytes(bad_type)))
    bad_length = bytearray(content)
    bad_length[1:5] = struct.pack(">I", 1 << 30)
    with pytest.raises(WalMessageInvalid, match="truncated"):
        list(wal_codec.decode(bytes(bad_length)))
    bad_text = bytearray(content)
    topic_at = 1 + 4 + 1 + 16 + 1 + 2
    bad_text[topic_at] = 0xFF  # not UTF-8
    with pytest.raises(WalMessageInvalid, match="garbled"):
        list(wal_codec.decode(bytes(bad_text)))
    with pytest.raises(WalMessageInvalid, match="empty"):
        list(wal_codec.decode(b""))
    with pytest.raises(WalMessageInvalid, match="no event"):
        list(wal_codec.decode(bytes([wal_codec.VERSION])))


def test_an_unknown_version_is_a_typed_error_that_says_upgrade() -> None:
    content = bytes([2]) + wal_codec.encode([_row()])[1:]  # type: ignore[list-item]
    with pytest.raises(WalVersionUnknown, match="upgrade the relay") as caught:
        list(wal_codec.decode(content))
    assert caught.value.version == 2


def _begin(final_lsn: int, micros: int) -> bytes:
    return b"B" + struct.pack(">qqi", final_lsn, micros, 1234)


def _message(prefix: str, content: bytes, transactional: bool = True) -> bytes:
    return (
        b"M"
        + struct.pack(">Bq", int(transactional), 77)
        + prefix.encode()
        + b"\x00"
        + struct.pack(">i", len(content))
        + content
    )


def test_pgoutput_records() -> None:
    begin = pgoutput.begin(_begin(0x1_0000_0010, 1_000_000))
    assert begin == pgoutput.Begin(
        0x1_0000_0010, "2000-01-01T00:00:01.000000Z", 946_684_801.0, 1_000_000
    )
    assert begin.moment == dt.datetime(2000, 1, 1, 0, 0, 1, tzinfo=dt.UTC)
    msg = pgoutput.message(_message("outbox", b"abc"))
    assert (msg.transactional, msg.lsn, msg.prefix, bytes(msg.content)) == (
        True,
        77,
        "outbox",
        b"abc",
    )
    commit = pgoutput.commit(b"C" + struct.pack(">Bqqq", 0, 10, 20, 5))
    assert commit.end_lsn == 20


def test_broken_pgoutput_records_are_typed_errors() -> None:
    with pytest.raises(WalRecordInvalid):
        pgoutput.begin(b"B\x00")
    with pytest.raises(WalRecordInvalid):
        pgoutput.message(_message("outbox", b"abc")[:-1])
    with pytest.raises(WalRecordInvalid):
        pgoutput.message(b"M" + struct.pack(">Bq", 1, 77) + b"no-nul")
    with pytest.raises(WalRecordInvalid):
        pgoutput.commit(b"C\x00")


def test_event_ids_survive() -> None:
    event_id = uuid.uuid4()
    (event,) = wal_codec.decode(wal_codec.encode([_row(event_id=event_id)]))  # type: ignore[list-item]
    assert event.event_id == str(event_id)

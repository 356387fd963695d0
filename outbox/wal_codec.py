"""The binary encoding of events carried as WAL messages (``source = "wal"``).

A producer in WAL mode writes each event as the content of a logical-decoding message
(``pg_logical_emit_message``); the relay decodes it. The content is small and versioned:

    u8  version (1)
    then one or more events, each:
    u32 length of the event that follows
    u8  flags          bit 0: key present, bit 1: tombstone (no payload), bit 2: headers
    16  event id (UUID bytes)
    u8  content type   0 none (tombstone), 1 application/json, 2 application/octet-stream
    u16 + bytes        topic (UTF-8)
    u16 + bytes        event type (UTF-8)
    u16 + bytes        CloudEvents source (UTF-8)
    u32 + bytes        key, when flag bit 0
    u32 + bytes        headers as compact JSON text, when flag bit 2
    rest               payload, unless a tombstone

Integers are big-endian. The length prefix lets a decoder of a later version 1 skip fields
appended at the end of an event; anything else new takes a new version number, which an
older relay refuses (:class:`WalVersionUnknown`) instead of guessing. The creation time is
not carried: the relay uses the transaction's commit time, which pgoutput sends anyway.
Headers stay JSON text because that is what the outbox row holds and what the relay's
publisher takes: no conversion on either side.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from outbox.envelope import JSON, OCTET_STREAM, Row
from outbox.errors import ConfigurationError

VERSION = 1
_KEY, _TOMBSTONE, _HEADERS = 1, 2, 4
_CONTENT_TYPES: dict[str | None, int] = {None: 0, JSON: 1, OCTET_STREAM: 2}
_CONTENT_NAMES: tuple[str | None, ...] = (None, JSON, OCTET_STREAM)
_LEN32 = struct.Struct(">I")
_HEAD = struct.Struct(">B16sBH")  # after the length: flags, id, content type, topic length
_LEN16 = struct.Struct(">H")
_EMPTY_HEADERS = "{}"


class WalMessageInvalid(ConfigurationError):
    """A WAL message under the outbox prefix that is not an event this relay can read
    (truncated, garbled, or written by something else under the same prefix). The relay
    stops rather than skip it: an event would be lost silently."""


class WalVersionUnknown(WalMessageInvalid):
    """A WAL message written in an encoding version this relay does not know: a newer
    producer. Upgrade the relay."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"WAL message encoding version {version} is unknown to this relay (it reads "
            f"version {VERSION}); upgrade the relay to the producers' version"
        )
        self.version = version


class WalEvent(NamedTuple):
    """One decoded event: the fields of an outbox row the relay publishes."""

    event_id: str  # canonical text form, as the relay's ce_id header carries it
    topic: str
    key: bytes | None
    event_type: str
    source: str
    content_type: str | None
    payload: bytes | None
    headers: str  # compact JSON text, "{}" when none


def _str16(value: str) -> bytes:
    data = value.encode()
    return _LEN16.pack(len(data)) + data


def _encode_one(row: Row) -> bytes:
    flags = 0
    parts: list[bytes] = []
    if row.key is not None:
        flags |= _KEY
    if row.payload is None:
        flags |= _TOMBSTONE
    if row.headers != _EMPTY_HEADERS:
        flags |= _HEADERS
    topic = row.topic.encode()
    parts.append(
        _HEAD.pack(flags, row.event_id.bytes, _CONTENT_TYPES[row.content_type], len(topic))
    )
    parts.append(topic)
    parts.append(_str16(row.event_type))
    parts.append(_str16(row.source))
    if row.key is not None:
        parts.append(_LEN32.pack(len(row.key)))
        parts.append(row.key)
    if flags & _HEADERS:
        headers = row.headers.encode()
        parts.append(_LEN32.pack(len(headers)))
        parts.append(headers)
    if row.payload is not None:
        parts.append(row.payload)
    body = b"".join(parts)
    return _LEN32.pack(len(body)) + body


def encode(rows: Sequence[Row]) -> bytes:
    """One message's content carrying ``rows`` (at least one), in order."""
    if not rows:
        raise ValueError("a WAL message carries at least one event")
    return bytes((VERSION,)) + b"".join(_encode_one(r) for r in rows)


def decode(content: bytes | memoryview) -> Iterator[WalEvent]:
    """The events of one message's content, in order; :class:`WalMessageInvalid` (or its
    :class:`WalVersionUnknown`) when it is not one this relay can read."""
    # The relay's hot path (one pass per event, no call per field): plain slices and one
    # bounds check per event (a slice past the end is short, never an error, so a
    # truncated field shows up as pos > stop).
    data = bytes(content)
    if not data:
        raise WalMessageInvalid("empty WAL message")
    if data[0] != VERSION:
        raise WalVersionUnknown(data[0])
    pos, end = 1, len(data)
    if pos == end:
        raise WalMessageInvalid("WAL message carries no event")
    len32, len16, head, head_size = (
        _LEN32.unpack_from,
        _LEN16.unpack_from,
        _HEAD.unpack_from,
        _HEAD.size,
    )
    names, new_tuple = _CONTENT_NAMES, tuple.__new__
    while pos < end:
        start = pos
        try:
            (size,) = len32(data, pos)
            pos += 4
            stop = pos + size
            if stop > end:
                raise WalMessageInvalid(
                    f"truncated WAL message: event of {size} bytes, {end - pos} left"
                )
            flags, raw_id, ctype, n = head(data, pos)
            pos += head_size
            topic = data[pos : pos + n].decode()
            pos += n
            (n,) = len16(data, pos)
            pos += 2
            event_type = data[pos : pos + n].decode()
            pos += n
            (n,) = len16(data, pos)
            pos += 2
            source = data[pos : pos + n].decode()
            pos += n
            key: bytes | None = None
            if flags & _KEY:
                (n,) = len32(data, pos)
                pos += 4
                key = data[pos : pos + n]
                pos += n
            headers = _EMPTY_HEADERS
            if flags & _HEADERS:
                (n,) = len32(data, pos)
                pos += 4
                headers = data[pos : pos + n].decode()
                pos += n
        except (struct.error, UnicodeDecodeError) as exc:
            raise WalMessageInvalid(f"garbled WAL message at byte {start}: {exc}") from None
        if pos > stop:
            raise WalMessageInvalid(f"truncated WAL message: fields end past byte {stop}")
        if ctype >= len(names):
            raise WalMessageInvalid(f"garbled WAL message: content type code {ctype}")
        tombstone = flags & _TOMBSTONE
        if bool(tombstone) != (ctype == 0):
            raise WalMessageInvalid("garbled WAL message: tombstone flag and content type differ")
        h = raw_id.hex()
        # tuple.__new__ builds the WalEvent without the Python-level __new__ frame.
        yield new_tuple(
            WalEvent,
            (
                f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}",
                topic,
                key,
                event_type,
                source,
                names[ctype],
                None if tombstone else data[pos:stop],
                headers,
            ),
        )
        pos = stop

"""Turning a user's message into an outbox row: payload encoding, lanes, ids, checks.

Everything here is pure (no I/O) so it is shared by the sync and async publish paths and
unit-tested without a database.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Required, TypedDict

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, to_json

from outbox import identifiers
from outbox.canonical import canonical_json, check_finite
from outbox.errors import InvalidText, InvalidTopic, PayloadError, PayloadTooLarge

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
# The CloudEvents `sequence` extension, set from ``publish(..., sequence=N)``. The spec
# compares sequence values as strings, so N is written zero-padded to 20 digits: string
# order is then numeric order for every non-negative 64-bit integer.
SEQUENCE_HEADER = "ce_sequence"
# Headers the relay writes itself (CloudEvents Kafka binding, binary mode).
RESERVED_HEADERS = frozenset(
    {"ce_id", "ce_type", "ce_source", "ce_time", "ce_specversion", "content-type", SEQUENCE_HEADER}
)
MAX_SEQUENCE = 2**63 - 1
MAX_EVENT_TYPE_CHARS = 255
# The WAL encoding's length field (u16); the same limit in both sources.
MAX_SOURCE_BYTES = 65_535
# 100 years: PostgreSQL's timestamps end in 294276 AD, and no delay needs more.
MAX_DELAY_SECONDS = 3_155_760_000


class Tombstone(enum.Enum):
    """The type of :data:`TOMBSTONE` (an enum of one member: a typed singleton)."""

    TOMBSTONE = "TOMBSTONE"

    def __repr__(self) -> str:
        return "outbox.TOMBSTONE"


TOMBSTONE: Final = Tombstone.TOMBSTONE
"""The payload of a tombstone: a record with a null value, which deletes its key from a
compacted topic (``cleanup.policy=compact``) once the log cleaner has run. It needs a key,
keeps its place in the key's order and carries the CloudEvents headers (``ce_type`` says
what happened, e.g. ``customer.deleted``) but no ``content-type``. ``payload=None`` is
refused: a payload that is missing by mistake must not delete anything."""

Payload = BaseModel | Mapping[str, Any] | list[Any] | bytes | bytearray | memoryview | Tombstone


class MessageFields(TypedDict, total=False):
    """Keyword arguments of ``Outbox.publish`` (the fields of :class:`Message`)."""

    topic: Required[str]
    payload: Required[Payload]
    event_type: Required[str]
    key: str | bytes | None
    event_id: uuid.UUID | str | None
    headers: Mapping[str, str]
    source: str | None
    delay_seconds: float
    sequence: int | None


@dataclass(frozen=True)
class Message:
    """One event to publish. ``publish_many`` takes a list of these."""

    topic: str
    payload: Payload
    event_type: str
    key: str | bytes | None = None
    event_id: uuid.UUID | str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None
    delay_seconds: float = 0.0
    # The key's version (e.g. the aggregate's version): consumers with a stale-event guard
    # skip an event whose sequence is not above the highest one they applied for its key.
    sequence: int | None = None


@dataclass(frozen=True)
class Row:
    """A validated, encoded outbox row (column values, minus server defaults)."""

    event_id: uuid.UUID
    topic: str
    key: bytes | None
    lane: int
    event_type: str
    source: str
    content_type: str | None  # None for a tombstone
    payload: bytes | None  # None for a tombstone
    headers: str  # JSON text of a str -> str mapping
    fingerprint: bytes
    delay_seconds: float


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (RFC 9562 version 7): 48-bit ms timestamp + 74 random bits."""
    ms = time.time_ns() // 1_000_000
    raw = bytearray(ms.to_bytes(6, "big") + os.urandom(10))
    raw[6] = (raw[6] & 0x0F) | 0x70
    raw[8] = (raw[8] & 0x3F) | 0x80
    return uuid.UUID(bytes=bytes(raw))


def lane_for(key: bytes | None, event_id: uuid.UUID, lanes: int) -> int:
    """The ordering lane of a key: a stable hash, identical in every process and version.

    Keyless events carry no ordering promise, so they spread over lanes by event id.
    """
    material = key if key is not None else event_id.bytes
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big") % lanes


def encode_payload(payload: Payload) -> tuple[bytes | None, str | None]:
    """Payload bytes and their content type; ``(None, None)`` for :data:`TOMBSTONE`.

    Pydantic models serialize themselves. JSON never carries NaN or infinity
    (:func:`~outbox.canonical.check_finite`).
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), OCTET_STREAM
    if payload is TOMBSTONE:
        return None, None
    if payload is None:
        raise PayloadError(
            "payload is None; to delete the key from a compacted topic publish "
            "payload=outbox.TOMBSTONE (None is refused so that a missing payload never "
            "deletes a key by accident)",
            "payload",
        )
    try:
        if isinstance(payload, BaseModel):
            data = payload.model_dump_json().encode()
        elif isinstance(payload, Mapping | list):
            data = to_json(payload)
        else:
            raise PayloadError(
                "payload must be a pydantic model, a dict or list (JSON), bytes or "
                f"outbox.TOMBSTONE, not {type(payload).__name__}",
                "payload",
            )
    except PydanticSerializationError as exc:
        # e.g. an object JSON has no form for, a lone surrogate, nesting too deep.
        raise PayloadError(f"payload is not JSON-serializable: {exc}", "payload") from None
    # A NaN or infinity shows up in the output as one of these words (pydantic models write
    # null by default). Only then is the payload walked: the word may be inside a string.
    if b"NaN" in data or b"Infinity" in data or b"null" in data:
        check_finite(payload, "payload")
    return data, JSON


def _encode_key(key: str | bytes | None) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidText("key", _surrogate(exc)) from None
    raise PayloadError(f"key must be str, bytes or None, not {type(key).__name__}", "key")


def _surrogate(exc: UnicodeEncodeError) -> str:
    return (
        f"holds a lone surrogate at index {exc.start} (not encodable as UTF-8); "
        "give bytes for binary data"
    )


def text_bytes(value: object, field: str) -> int:
    """The UTF-8 size of a text field; a typed error when it is not text that a column, a
    JSON document and a Kafka header can all carry (see :class:`InvalidText`)."""
    if not isinstance(value, str):
        raise PayloadError(f"{field} must be a string, not {type(value).__name__}", field)
    if "\x00" in value:
        raise InvalidText(
            field, "holds a NUL character (U+0000), which PostgreSQL text and jsonb cannot store"
        )
    if value.isascii():  # O(1) in CPython: the common case costs no encoding
        return len(value)
    try:
        return len(value.encode())
    except UnicodeEncodeError as exc:
        raise InvalidText(field, _surrogate(exc)) from None


def _event_id(value: uuid.UUID | str | None) -> uuid.UUID:
    if value is None:
        return uuid7()
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        pass
    raise PayloadError(
        f"event_id {value!r:.80} is not a UUID; derive one with outbox.idempotency_key()",
        "event_id",
    )


def _headers(headers: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """The headers as a plain dict, and their size in bytes (names and values)."""
    if type(headers) is not dict and not isinstance(headers, Mapping):
        raise PayloadError(
            f"headers must be a mapping of str to str, not {type(headers).__name__}", "headers"
        )
    out: dict[str, str] = {}
    size = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise PayloadError("headers must map str to str", "headers")
        if name.lower() in RESERVED_HEADERS:
            raise PayloadError(
                f"header {name!r} is reserved: the relay sets it from the row", "headers"
            )
        if name.isascii() and value.isascii() and "\x00" not in name and "\x00" not in value:
            size += len(name) + len(value)  # the usual header: no encoding, no call
        else:
            size += text_bytes(name, "headers")
            try:
                size += text_bytes(value, "header")
            except InvalidText as exc:  # named here: the f-string costs on every header
                raise InvalidText(f"header {name!r:.80}", exc.reason) from None
        out[name] = value
    return out, size


def _sequence(value: int | None, key: bytes | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQUENCE:
        raise PayloadError(f"sequence must be an integer from 0 to {MAX_SEQUENCE}", "sequence")
    if key is None:
        raise PayloadError("sequence needs a key: it orders the versions of one key", "sequence")
    return f"{value:020d}"


def _delay(value: object) -> float:
    """``delay_seconds`` as a float: finite, from 0 to :data:`MAX_DELAY_SECONDS`."""
    if (type(value) is float or type(value) is int) and 0 <= value <= MAX_DELAY_SECONDS:
        return float(value)
    if type(value) is not float and type(value) is not int:
        try:
            if isinstance(value, bool | str | bytes):
                raise TypeError
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            raise PayloadError(
                f"delay_seconds must be a number, not {type(value).__name__}", "delay_seconds"
            ) from None
    # NaN fails both comparisons; an infinity the upper one.
    if not 0 <= value <= MAX_DELAY_SECONDS:
        raise PayloadError(
            f"delay_seconds must be a finite number from 0 to {MAX_DELAY_SECONDS} (100 "
            f"years), not {value!r}",
            "delay_seconds",
        )
    return float(value)


def fingerprint(topic: str, key: bytes | None, event_type: str, payload: bytes | None) -> bytes:
    """What identifies an event's content (stored with a row to spot a reused event_id)."""
    h = hashlib.sha256()
    for part in (topic.encode(), key, event_type.encode(), payload):
        # Length-prefix each part so that ("ab", "c") and ("a", "bc") differ; -1 marks None.
        h.update((-1 if part is None else len(part)).to_bytes(8, "big", signed=True))
        h.update(part or b"")
    return h.digest()


@dataclass(frozen=True)
class StoredEvent:
    """The columns of a stored event that say which event it is."""

    topic: str
    key: bytes | None
    event_type: str
    content_type: str | None
    payload: bytes | None


def same_event(row: Row, stored: StoredEvent) -> bool:
    """Whether ``stored`` is the event ``row`` describes although their fingerprints differ.

    Fingerprints hash the payload bytes, but a JSON payload re-encoded with its members in
    another order (or ``1.0`` for ``1``) is the same event: two JSON payloads are the same
    when their RFC 8785 canonical forms are. Called only after the fingerprints differ, so
    the common publish path never pays for canonicalization.
    """
    if (stored.topic, stored.key, stored.event_type) != (row.topic, row.key, row.event_type):
        return False
    if stored.payload is None or row.payload is None:
        return False  # a tombstone is the same event only with the same fingerprint
    if stored.content_type != JSON or row.content_type != JSON:
        return False
    try:
        return canonical_json(json.loads(stored.payload)) == canonical_json(json.loads(row.payload))
    except (ValueError, PayloadError):
        return False  # no canonical form (e.g. an integer beyond 2**53): the bytes decided


def prepare(message: Message, *, lanes: int, max_bytes: int, default_source: str) -> Row:
    """Validate and encode one message; raises a :class:`PayloadError` subclass if bad."""
    if not isinstance(message, Message):
        raise PayloadError(f"messages must be outbox.Message, not {type(message).__name__}")
    topic = message.topic
    if not identifiers.is_kafka_name(topic):
        raise InvalidTopic(identifiers.kafka_name_problem(topic))
    event_type = message.event_type
    if text_bytes(event_type, "event_type") == 0 or len(event_type) > MAX_EVENT_TYPE_CHARS:
        raise PayloadError(
            f"event_type must be a non-empty string of at most {MAX_EVENT_TYPE_CHARS} characters",
            "event_type",
        )
    source = message.source
    if source in (None, ""):  # the default source
        source = default_source
    elif text_bytes(source, "source") > MAX_SOURCE_BYTES:
        raise PayloadError(f"source is longer than {MAX_SOURCE_BYTES} bytes (UTF-8)", "source")
    delay = _delay(message.delay_seconds)
    payload, content_type = encode_payload(message.payload)
    key = _encode_key(message.key)
    if payload is None and key is None:
        raise PayloadError(
            "a tombstone needs a key: it deletes that key from a compacted topic", "key"
        )
    headers, size = _headers(message.headers)
    sequence = _sequence(message.sequence, key)
    if sequence is not None:
        headers[SEQUENCE_HEADER] = sequence
        size += len(SEQUENCE_HEADER) + len(sequence)
    size += len(payload or b"") + len(key or b"")
    if size > max_bytes:
        raise PayloadTooLarge(size, max_bytes)
    event_id = _event_id(message.event_id)
    return Row(
        event_id=event_id,
        topic=topic,
        key=key,
        lane=lane_for(key, event_id, lanes),
        event_type=event_type,
        source=source,
        content_type=content_type,
        payload=payload,
        headers=json.dumps(headers, separators=(",", ":")),
        fingerprint=fingerprint(topic, key, event_type, payload),
        delay_seconds=delay,
    )

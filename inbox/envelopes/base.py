"""What every envelope shares: the contract, the result of reading a record, and the ids of
records that cannot be read.

An envelope turns a Kafka record into what the inbox needs: the producer's event id, the
event type (or none), the payload bytes, the payload's content type and other metadata.
The built-in envelopes build the :class:`~inbox.event.InboxEvent` directly (``decode``, the
hot path); a user's envelope implements :class:`Envelope` (``open(record) -> Opened``) and
is wrapped by :class:`Custom`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from inbox import failures
from inbox.errors import EnvelopeError, Unreadable
from inbox.event import InboxEvent, KafkaRecord, header_text
from outbox.kafka.client import UndecodedHeader
from outbox.text import storable, unstorable

MAX_ID_CHARS = 255  # the inbox's event_id column
# Set by `outbox dlq replay` on the record it produces, and on every dead letter sent to a
# dead-letter topic: the id the inbox knows the event by. Read back only where an id is the
# record's position (see :func:`position_id`), which a replay necessarily changes.
EVENT_ID_HEADER = "dlq_event_id"
# A reason longer than this is cut (an exception message of a user's envelope may be long;
# dead-letter headers cut further to `error_message_chars`).
MAX_REASON_CHARS = 2_000

Headers = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class Opened:
    """What an envelope read from one record.

    ``event_id`` is the producer's id for the event (the dedupe key: the same event sent
    twice must give the same id). ``payload`` is the event's data, what handlers parse;
    ``None`` for an event without data. ``metadata`` holds CloudEvents-style attributes
    (``source``, ``time``, ``subject``, ``sequence``...): handlers read them with
    ``event.attribute(name)``, and ``sequence`` feeds the stale-event guard.

    Invalid values raise ``ValueError`` (inside ``open``, that makes the record unreadable).
    """

    event_id: str
    payload: bytes | None
    event_type: str | None = None
    content_type: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.event_id, str) or not self.event_id:
            raise ValueError(f"event_id must be a non-empty string, not {self.event_id!r:.60}")
        if len(self.event_id) > MAX_ID_CHARS:
            raise ValueError(f"event_id is longer than {MAX_ID_CHARS} characters")
        if self.payload is not None and not isinstance(self.payload, bytes):
            raise ValueError(f"payload must be bytes or None, not {type(self.payload).__name__}")
        event_type = self.event_type
        if event_type is not None and (not isinstance(event_type, str) or not event_type):
            raise ValueError(f"event_type must be a non-empty string or None: {event_type!r:.60}")
        if self.content_type is not None and not isinstance(self.content_type, str):
            raise ValueError("content_type must be a string or None")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise ValueError("metadata must map strings to strings")


@runtime_checkable
class Envelope(Protocol):
    """A user's envelope: ``open`` reads one record, or raises (any exception, ideally
    :class:`~inbox.errors.Unreadable` with a reason) when it cannot; the record is then
    dead-lettered with that reason. It must be pure: no I/O, the same answer for the same
    record. Optional ``typed``: False when it never yields an event type (its topics then
    take topic handlers only), True when it always does."""

    def open(self, record: KafkaRecord) -> Opened: ...


class Reader(Protocol):
    """The inbox's side of an envelope (the built-ins and :class:`Custom`)."""

    @property
    def name(self) -> str: ...

    @property
    def typed(self) -> bool | None: ...

    def decode(self, record: KafkaRecord) -> InboxEvent: ...


class BuiltIn:
    """Base of the built-in envelopes: they decode straight to an InboxEvent, and ``open``
    (for a user's envelope built on one of them) gives the same as an :class:`Opened`."""

    name: ClassVar[str]

    @property
    def typed(self) -> bool | None:
        return True

    def decode(self, record: KafkaRecord) -> InboxEvent:
        raise NotImplementedError

    def open(self, record: KafkaRecord) -> Opened:
        event = self.decode(record)
        if event.malformed is not None:
            raise Unreadable(event.malformed)
        if event.attributes is None:  # CloudEvents binary mode: the ce_* headers
            metadata = {
                name[3:]: text
                for name, raw in event.headers
                if name.startswith("ce_") and name not in ("ce_id", "ce_type")
                if (text := utf8(raw)) is not None
            }
        else:
            metadata = dict(event.attributes)
        metadata.pop("datacontenttype", None)
        return Opened(event.event_id, event.value, event.event_type, event.content_type, metadata)


def headers_of(record: KafkaRecord) -> Headers:
    return tuple((name, bytes(value or b"")) for name, value in record.headers)


def undecoded(raw_headers: Sequence[tuple[str, bytes | None]]) -> str | None:
    """Why a record's headers cannot be read (a name that is not UTF-8, which the Kafka
    client hands as an :class:`~outbox.kafka.client.UndecodedHeader`), or None."""
    for item in raw_headers:
        if type(item) is UndecodedHeader:
            name = item[0] if len(item[0]) <= 80 else item[0][:79] + "…"
            return f"header name {name} is not UTF-8 (its bytes shown escaped, \\xNN)"
    return None


def utf8(raw: bytes) -> str | None:
    """A header value as text; None when empty or not UTF-8."""
    try:
        return raw.decode("utf-8") or None
    except UnicodeDecodeError:
        return None


def header(headers: Sequence[tuple[str, bytes]], name: str) -> str | None:
    """Header ``name`` as text (the last one wins), None when absent, empty or not UTF-8."""
    for hname, raw in reversed(headers):
        if hname == name:
            return utf8(raw)
    return None


def position_id(record: KafkaRecord, headers: Headers) -> str:
    """``topic:partition:offset``, the id of a record by where it sits.

    A record ``outbox dlq replay`` produced sits elsewhere than the one dead-lettered; when
    that one's id was its position too, the replay keeps it (header ``dlq_event_id``), so
    that the replay claims the dead letter's inbox row and a repeated replay is a duplicate.
    """
    replayed = header_text(headers, EVENT_ID_HEADER) if headers else None
    if replayed is not None:
        topic, _, rest = replayed.partition(":")
        partition, _, offset = rest.partition(":")
        if topic == record.topic and partition.isdigit() and offset.isdigit():
            return replayed
    return f"{record.topic}:{record.partition}:{record.offset}"


def unreadable(
    record: KafkaRecord, headers: Headers, reason: str, event_type: str | None = None
) -> InboxEvent:
    """A record its envelope cannot read: malformed, with ``reason``, under its position.

    ``event_type`` and ``reason`` are kept as PostgreSQL text can hold them (a NUL or a
    lone surrogate escaped); the record's bytes are kept as they came."""
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    return InboxEvent(
        event_id=position_id(record, headers),
        event_type=None if event_type is None else storable(event_type),
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        headers=headers,
        malformed=storable(reason),
        timestamp_ms=record.timestamp,
    )


def opened_event(
    record: KafkaRecord,
    headers: Headers,
    event_id: str,
    event_type: str | None,
    payload: bytes | None,
    attributes: tuple[tuple[str, str], ...],
) -> InboxEvent:
    """The event an envelope read (``payload`` may be the record's value or a part of it);
    malformed when its id or type cannot be stored (the inbox keeps both as text), or a
    header name is not UTF-8 (an envelope reading it read what the producer did not send)."""
    problem = undecoded(record.headers) or unstorable(event_id, "the event id")
    if problem is None and event_type is not None:
        problem = unstorable(event_type, "the event type")
    if problem is not None:
        return unreadable(record, headers, problem, event_type)
    received = None if payload is record.value or payload == record.value else record.value
    return InboxEvent(
        event_id=event_id,
        event_type=event_type,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=payload,
        headers=headers,
        timestamp_ms=record.timestamp,
        received_value=received,
        attributes=attributes,
    )


def check_id(event_id: str, what: str) -> str | None:
    """Why ``event_id`` (read from ``what``) cannot be an inbox id, or None."""
    if len(event_id) > MAX_ID_CHARS:
        return f"{what} is longer than {MAX_ID_CHARS} characters"
    return None


def compact_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Custom:
    """A user's envelope (an :class:`Envelope`), read through its ``open``."""

    envelope: Envelope
    name: str

    @property
    def typed(self) -> bool | None:
        typed = getattr(self.envelope, "typed", None)
        return typed if isinstance(typed, bool) else None

    def decode(self, record: KafkaRecord) -> InboxEvent:
        headers = headers_of(record)
        try:
            opened = self.envelope.open(record)
        except Exception as exc:  # any failure to read is this record's reason
            reason = str(exc) if isinstance(exc, Unreadable) else _describe(exc)
            return unreadable(record, headers, f"{self.name}: {reason}")
        if not isinstance(opened, Opened):
            raise EnvelopeError(
                f"envelope {self.name} returned {type(opened).__name__} for "
                f"{record.topic}[{record.partition}]@{record.offset}, not an "
                "inbox.envelopes.Opened; fix it (nothing was committed: the record is read "
                "again after a restart)"
            )
        attributes = tuple(opened.metadata.items())
        if opened.content_type is not None:
            attributes += (("datacontenttype", opened.content_type),)
        return opened_event(
            record, headers, opened.event_id, opened.event_type, opened.payload, attributes
        )


def _describe(exc: Exception) -> str:
    # classify() reports a pydantic ValidationError by field locations only: its text
    # would echo the record's content into dead-letter headers and logs.
    return failures.classify(exc, MAX_REASON_CHARS).text()


@dataclass(frozen=True)
class FromFunction:
    """A plain function ``record -> Opened`` used as an envelope."""

    fn: Any

    def open(self, record: KafkaRecord) -> Opened:
        result: Opened = self.fn(record)
        return result

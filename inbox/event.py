"""What a handler receives: a Kafka record read through the CloudEvents binary binding.

Decoding is pure (no I/O). A record without a usable ``ce_id``/``ce_type`` is *malformed*:
it still gets a deterministic id (``topic:partition:offset``) so that its dead-lettering
is deduplicated like any other event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inbox.errors import InvalidSequence
from outbox.envelope import MAX_SEQUENCE, SEQUENCE_HEADER


class KafkaRecord(Protocol):
    """The parts of an aiokafka ``ConsumerRecord`` the inbox reads."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


@dataclass(frozen=True)
class InboxEvent:
    """One consumed record. ``malformed`` names what is wrong when it cannot be handled."""

    event_id: str
    event_type: str | None
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    malformed: str | None = None
    # The record's Kafka timestamp, ms since the epoch (producer's or broker's clock,
    # per the topic's message.timestamp.type).
    timestamp_ms: int | None = None

    def header(self, name: str) -> str | None:
        """A header decoded as UTF-8 (the last one wins when repeated), or None."""
        return header_text(self.headers, name)

    @property
    def source(self) -> str | None:
        return self.header("ce_source")

    @property
    def time(self) -> str | None:
        return self.header("ce_time")

    @property
    def content_type(self) -> str | None:
        return self.header("content-type")

    @property
    def sequence(self) -> int | None:
        """The CloudEvents ``sequence`` extension as an integer (None when absent).

        Raises :class:`~inbox.errors.InvalidSequence` when it is present but not a
        non-negative integer: a stale-event guard cannot order such an event.
        """
        text = self.header(SEQUENCE_HEADER)
        if text is None:
            return None
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_SEQUENCE:
            raise InvalidSequence(f"{SEQUENCE_HEADER} header {text[:40]!r} is not a 64-bit integer")
        return int(text)

    def json(self) -> Any:
        """The value parsed as JSON."""
        import json

        return json.loads(self.value or b"null")


def header_text(headers: Sequence[tuple[str, bytes]], name: str) -> str | None:
    """Header ``name`` decoded as UTF-8 (the last one wins when repeated), or None."""
    for hname, raw in reversed(headers):
        if hname == name:
            return raw.decode("utf-8", errors="replace")
    return None


def _text(raw: bytes | None) -> str | None:
    """A CloudEvents attribute header's value: UTF-8, not empty; else None."""
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def decode(record: KafkaRecord) -> InboxEvent:
    """The event in ``record``: its id and type from the CloudEvents binary headers (the
    last ``ce_id`` / ``ce_type`` wins when repeated), or malformed.

    This runs once per consumed record, so it reads the headers in one pass and keeps
    aiokafka's (name, bytes) pairs as they are; other header values (a null header, a
    buffer) are made bytes.
    """
    raw = record.headers
    event_id = event_type = None
    exact = True
    for item in raw:
        name, value = item
        if type(value) is not bytes or type(item) is not tuple:
            exact = False
            value = bytes(value or b"")
        if name == "ce_id":
            event_id = value
        elif name == "ce_type":
            event_type = value
    headers = tuple(raw) if exact else tuple((n, bytes(v or b"")) for n, v in raw)
    eid, etype = _text(event_id), _text(event_type)
    problem = None
    if eid is None:
        problem = "missing or invalid ce_id header"
    elif len(eid) > 255:
        problem = "ce_id header longer than 255 characters"
    elif etype is None:
        problem = "missing or invalid ce_type header"
    if problem is not None:
        eid = f"{record.topic}:{record.partition}:{record.offset}"
    # Every field set at once: a frozen dataclass's __init__ sets them one by one through
    # object.__setattr__, half of this function's cost.
    event = object.__new__(InboxEvent)
    event.__dict__.update(
        event_id=eid,
        event_type=etype,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        headers=headers,
        malformed=problem,
        timestamp_ms=record.timestamp,
    )
    return event

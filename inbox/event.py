"""What a handler receives: a Kafka record as its envelope read it (see ``inbox/envelopes``).

Decoding is pure (no I/O). A record its envelope cannot read is *malformed*: it still
gets a deterministic id (``topic:partition:offset``) so that its dead-lettering is
deduplicated like any other event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inbox.errors import InvalidSequence
from outbox.envelope import MAX_SEQUENCE

SEQUENCE_ATTRIBUTE = "sequence"  # the CloudEvents sequence extension (header ce_sequence)


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
    # Set when the envelope took the event's data out of the record's value (a structured
    # CloudEvent's ``data``, a JsonConverter wrapper): the value as received, which dead
    # letters and replays carry. None: ``value`` is the record's value.
    received_value: bytes | None = None
    # The event's attributes (CloudEvents context attributes and extensions: ``source``,
    # ``time``, ``sequence``, ``datacontenttype``...) when the envelope found them elsewhere
    # than in ``ce_*`` headers. None: read from the headers (CloudEvents binary mode).
    attributes: tuple[tuple[str, str], ...] | None = None

    def header(self, name: str) -> str | None:
        """A header decoded as UTF-8 (the last one wins when repeated), or None."""
        return header_text(self.headers, name)

    def attribute(self, name: str) -> str | None:
        """A CloudEvents attribute or extension (``source``, ``time``, ``subject``...): the
        envelope's, or else the record's ``ce_<name>`` header."""
        if self.attributes is None:
            return self.header("ce_" + name)
        for key, value in self.attributes:
            if key == name:
                return value
        return None

    @property
    def record_value(self) -> bytes | None:
        """The record's value as received (``value`` is the event's data in it)."""
        return self.value if self.received_value is None else self.received_value

    @property
    def source(self) -> str | None:
        return self.attribute("source")

    @property
    def time(self) -> str | None:
        return self.attribute("time")

    @property
    def content_type(self) -> str | None:
        if self.attributes is None:
            return self.header("content-type")
        return self.attribute("datacontenttype")

    @property
    def sequence(self) -> int | None:
        """The CloudEvents ``sequence`` extension as an integer (None when absent).

        Raises :class:`~inbox.errors.InvalidSequence` when it is present but not a
        non-negative integer: a stale-event guard cannot order such an event.
        """
        text = self.attribute(SEQUENCE_ATTRIBUTE)
        if text is None:
            return None
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_SEQUENCE:
            raise InvalidSequence(f"sequence {text[:40]!r} is not a non-negative 64-bit integer")
        return int(text)

    def json(self) -> Any:
        """The event's data (``value``) parsed as JSON."""
        import json

        return json.loads(self.value or b"null")


def header_text(headers: Sequence[tuple[str, bytes]], name: str) -> str | None:
    """Header ``name`` decoded as UTF-8 (the last one wins when repeated), or None."""
    for hname, raw in reversed(headers):
        if hname == name:
            return raw.decode("utf-8", errors="replace")
    return None

"""What a handler receives: a Kafka record read through the CloudEvents binary binding.

Decoding is pure (no I/O). A record without a usable ``ce_id``/``ce_type`` is *malformed*:
it still gets a deterministic id (``topic:partition:offset``) so that its dead-lettering
is deduplicated like any other event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import confluent_kafka as ck


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
        for hname, raw in reversed(self.headers):
            if hname == name:
                return raw.decode("utf-8", errors="replace")
        return None

    @property
    def source(self) -> str | None:
        return self.header("ce_source")

    @property
    def time(self) -> str | None:
        return self.header("ce_time")

    @property
    def content_type(self) -> str | None:
        return self.header("content-type")

    def json(self) -> Any:
        """The value parsed as JSON."""
        import json

        return json.loads(self.value or b"null")


def _text(headers: Sequence[tuple[str, bytes]], name: str) -> str | None:
    for hname, raw in reversed(headers):
        if hname == name:
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                return None
            return text or None
    return None


def decode(record: ck.Message) -> InboxEvent:
    topic, partition, offset = record.topic() or "", record.partition() or 0, record.offset() or 0
    # A consumed record's headers are a list of (name, bytes or None); never a dict.
    raw_headers: Any = record.headers() or ()
    headers = tuple((name, bytes(value or b"")) for name, value in raw_headers)
    event_id = _text(headers, "ce_id")
    event_type = _text(headers, "ce_type")
    problem = None
    if event_id is None:
        problem = "missing or invalid ce_id header"
    elif len(event_id) > 255:
        problem = "ce_id header longer than 255 characters"
    elif event_type is None:
        problem = "missing or invalid ce_type header"
    if problem is not None:
        event_id = f"{topic}:{partition}:{offset}"
    assert event_id is not None
    kind, timestamp = record.timestamp()
    return InboxEvent(
        event_id=event_id,
        event_type=event_type,
        topic=topic,
        partition=partition,
        offset=offset,
        key=record.key(),
        value=record.value(),
        headers=headers,
        malformed=problem,
        timestamp_ms=timestamp if kind else None,
    )

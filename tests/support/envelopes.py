"""Users' own envelopes, named ``tests.support.envelopes:ATTR`` by the tests.

The "legacy" wire format: the id in header ``x-msg-id``, the type in ``x-kind``, the value
the payload. ``strict`` also insists on header ``x-schema: 2`` (a bug the tests "fix" by
switching to ``legacy``); ``garbage`` breaks the contract.
"""

from __future__ import annotations

from typing import Any

from inbox.envelopes import Opened, Unreadable
from inbox.event import KafkaRecord


def _header(record: KafkaRecord, name: str) -> str | None:
    for hname, raw in reversed(list(record.headers)):
        if hname == name:
            return bytes(raw).decode()
    return None


def legacy(record: KafkaRecord) -> Opened:
    event_id = _header(record, "x-msg-id")
    if event_id is None:
        raise Unreadable("no x-msg-id header")
    return Opened(
        event_id=event_id,
        payload=record.value,
        event_type=_header(record, "x-kind"),
        content_type="application/json",
        metadata={"source": "urn:legacy"},
    )


def strict(record: KafkaRecord) -> Opened:
    if _header(record, "x-schema") != "2":
        raise Unreadable("x-schema is not 2")
    return legacy(record)


class Legacy:
    """The same as a class (made with no arguments when named by MODULE:ATTR)."""

    typed = True

    def open(self, record: KafkaRecord) -> Opened:
        return legacy(record)


def garbage(record: KafkaRecord) -> Any:
    return {"id": "not an Opened"}


def crashes(record: KafkaRecord) -> Opened:
    return Opened(event_id=record.value.decode(), payload=b"")  # type: ignore[union-attr]


NOT_AN_ENVELOPE = 42

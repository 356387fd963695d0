"""Producers with no envelope of their own: the id and the type from named headers, from
JSON pointers (RFC 6901) into the value, or the id from the record's position.

::

    Generic(id=Header("message-id"), type=Header("message-type"))
    Generic(id=Pointer("/meta/id"), type=Pointer("/meta/type"), payload=Pointer("/data"))
    Generic(id=Position())          # the same as envelope="position"

The record's position (``topic:partition:offset``) as the id catches what a consumer
delivers twice — redeliveries after a crash, a rebalance, an offset reset — and nothing a
producer sent twice: its second copy sits at another offset, so it gets another id and is
applied again. Use it only for producers that never retry or resend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from inbox.envelopes.base import (
    BuiltIn,
    Headers,
    check_id,
    compact_json,
    header,
    headers_of,
    opened_event,
    position_id,
    unreadable,
)
from inbox.errors import EnvelopeError
from inbox.event import InboxEvent, KafkaRecord

_MISSING: Any = object()


@dataclass(frozen=True)
class Header:
    """A field read from the record header ``name`` (UTF-8 text)."""

    name: str

    def describe(self) -> str:
        return f"header {self.name!r}"


@dataclass(frozen=True)
class Pointer:
    """A field read from the JSON value at an RFC 6901 pointer, e.g. ``/meta/id``; ``""``
    is the whole value. Strings and integers make ids; the type must be a string."""

    path: str
    tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.path and not self.path.startswith("/"):
            raise EnvelopeError(f"JSON pointer {self.path!r} must be empty or start with '/'")
        parts = self.path.split("/")[1:]
        for part in parts:
            if "~" in part.replace("~0", "").replace("~1", ""):
                raise EnvelopeError(f"JSON pointer {self.path!r}: '~' must be '~0' or '~1'")
        tokens = tuple(p.replace("~1", "/").replace("~0", "~") for p in parts)
        object.__setattr__(self, "tokens", tokens)

    def describe(self) -> str:
        return f"{self.path or '/'} in the value"

    def find(self, doc: Any) -> Any:
        """The value at this pointer, or ``_MISSING``."""
        for token in self.tokens:
            if isinstance(doc, dict):
                doc = doc.get(token, _MISSING)
                if doc is _MISSING:
                    return _MISSING
            elif isinstance(doc, list) and token.isdigit() and (token == "0" or token[0] != "0"):
                index = int(token)
                if index >= len(doc):
                    return _MISSING
                doc = doc[index]
            else:
                return _MISSING
        return doc


@dataclass(frozen=True)
class Position:
    """The id is the record's position, ``topic:partition:offset`` (see the module
    docstring for what that catches and what it cannot)."""


Source = Header | Pointer


@dataclass(frozen=True)
class Generic(BuiltIn):
    """Id and type (and optionally the sequence and the payload) from named places; the
    payload is the whole value unless ``payload`` points into it."""

    id: Header | Pointer | Position
    type: Source | None = None
    sequence: Source | None = None
    payload: Pointer | None = None

    name = "generic"

    def __post_init__(self) -> None:
        for what, given, kinds in (
            ("id", self.id, (Header, Pointer, Position)),
            ("type", self.type, (Header, Pointer, type(None))),
            ("sequence", self.sequence, (Header, Pointer, type(None))),
            ("payload", self.payload, (Pointer, type(None))),
        ):
            if not isinstance(given, kinds):
                allowed = ", ".join(k.__name__ for k in kinds if k is not type(None))
                raise EnvelopeError(f"Generic({what}=...) takes {allowed}, not {given!r:.60}")

    @property
    def typed(self) -> bool:
        return self.type is not None

    @property
    def _reads_value(self) -> bool:
        sources = (self.id, self.type, self.sequence, self.payload)
        return any(isinstance(s, Pointer) for s in sources)

    def decode(self, record: KafkaRecord) -> InboxEvent:
        headers = headers_of(record)
        doc: Any = _MISSING
        if self._reads_value:
            if record.value is None:
                return unreadable(record, headers, "generic: no value (a tombstone)")
            try:
                doc = json.loads(record.value)
            except ValueError as exc:
                return unreadable(record, headers, f"generic: the value is not JSON ({exc})")
        if isinstance(self.id, Position):
            event_id: str | None = position_id(record, headers)
        else:
            event_id = _text(self.id, headers, doc, ids=True)
        if event_id is None:
            assert not isinstance(self.id, Position)
            return unreadable(record, headers, f"generic: no event id at {self.id.describe()}")
        if (problem := check_id(event_id, "the event id")) is not None:
            return unreadable(record, headers, f"generic: {problem}")
        event_type = None
        if self.type is not None:
            event_type = _text(self.type, headers, doc)
            if event_type is None:
                return unreadable(
                    record, headers, f"generic: no event type at {self.type.describe()}"
                )
        payload = record.value
        if self.payload is not None:
            found = self.payload.find(doc)
            if found is _MISSING:
                return unreadable(
                    record, headers, f"generic: no payload at {self.payload.describe()}"
                )
            payload = compact_json(found)
        return opened_event(
            record, headers, event_id, event_type, payload, self._attributes(headers, doc)
        )

    def _attributes(self, headers: Headers, doc: Any) -> tuple[tuple[str, str], ...]:
        content_type = header(headers, "content-type")
        if content_type is None and doc is not _MISSING:
            content_type = "application/json"
        attributes: tuple[tuple[str, str], ...] = ()
        if content_type is not None:
            attributes += (("datacontenttype", content_type),)
        if self.sequence is not None:
            sequence = _text(self.sequence, headers, doc, ids=True)
            if sequence is not None:
                attributes += (("sequence", sequence),)
        return attributes


def _text(source: Source, headers: Headers, doc: Any, *, ids: bool = False) -> str | None:
    """The text at ``source``; None when absent or of the wrong kind (integers count as
    text for ids and sequences)."""
    if isinstance(source, Header):
        return header(headers, source.name)
    found = source.find(doc)
    if isinstance(found, str):
        return found or None
    if ids and isinstance(found, int) and not isinstance(found, bool):
        return str(found)
    return None

"""The Debezium outbox event router's records.

What the router writes by default: the event id in a header (``id``, from
``table.field.event.id``), the aggregate id as the key, the payload column as the value,
no event type. The value's JSON comes in three shapes, all read here:

* the bare payload (``{"orderId": 1}``: a ``jsonb`` payload column with
  ``table.expand.json.payload=true``, or a JsonConverter without schemas);
* a JSON string holding the payload (``"{\\"orderId\\": 1}"``: a text or JSON column
  written by a StringConverter-less JsonConverter, the router's documented example);
* the JsonConverter's wrapper with ``schemas.enable=true``: ``{"schema": ..., "payload": ...}``
  around either of the above.

The type reaches the record only when the router is told to place it:
``table.fields.additional.placement=type:header:eventType`` (give ``type_header``) or
``type:envelope:eventType`` (give ``type_field``: the value is then an object holding
``payload`` and that field). Headers written by a JsonConverter header converter
(JSON-quoted strings) are unquoted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inbox.envelopes.base import (
    BuiltIn,
    check_id,
    compact_json,
    header,
    headers_of,
    opened_event,
    unreadable,
)
from inbox.event import InboxEvent, KafkaRecord

_JSON: tuple[tuple[str, str], ...] = (("datacontenttype", "application/json"),)


@dataclass(frozen=True)
class Debezium(BuiltIn):
    """Records of the Debezium outbox event router (see the module docstring).

    ``id_header``: the header holding the event id (the router's default ``id``).
    ``type_header`` / ``type_field``: where the router places the event type, if anywhere.
    ``sequence_header``: a header holding the aggregate's version, for handlers with a
    stale-event guard (e.g. ``table.fields.additional.placement=version:header:sequence``).
    """

    id_header: str = "id"
    type_header: str | None = None
    type_field: str | None = None
    sequence_header: str | None = None

    name = "debezium"

    @property
    def typed(self) -> bool:
        return self.type_header is not None or self.type_field is not None

    def decode(self, record: KafkaRecord) -> InboxEvent:
        headers = headers_of(record)
        event_id = _unquoted(header(headers, self.id_header))
        if event_id is None:
            return unreadable(
                record, headers, f"debezium: no {self.id_header!r} header with the event id"
            )
        if (problem := check_id(event_id, f"the {self.id_header!r} header")) is not None:
            return unreadable(record, headers, f"debezium: {problem}")
        event_type = None
        if self.type_header is not None:
            event_type = _unquoted(header(headers, self.type_header))
            if event_type is None:
                return unreadable(
                    record, headers, f"debezium: no {self.type_header!r} header with the type"
                )
        attributes = _JSON
        if self.sequence_header is not None:
            sequence = _unquoted(header(headers, self.sequence_header))
            if sequence is not None:
                attributes += (("sequence", sequence),)
        if record.value is None:
            if self.type_field is not None:
                return unreadable(record, headers, "debezium: no value (a tombstone)")
            # route.tombstone.on.empty.payload: an event whose payload was empty.
            return opened_event(record, headers, event_id, event_type, None, attributes)
        try:
            doc = json.loads(record.value)
        except ValueError as exc:
            return unreadable(record, headers, f"debezium: the value is not JSON ({exc})")
        payload: Any = doc
        if isinstance(doc, dict) and doc.keys() == {"schema", "payload"}:
            payload = doc["payload"]  # JsonConverter with schemas.enable=true
        if self.type_field is not None:
            if not isinstance(payload, dict) or "payload" not in payload:
                return unreadable(
                    record, headers, "debezium: the value is not an object with a payload"
                )
            event_type = payload.get(self.type_field)
            if not isinstance(event_type, str) or not event_type:
                return unreadable(
                    record, headers, f"debezium: no {self.type_field!r} field with the type"
                )
            payload = payload["payload"]
        if isinstance(payload, str) and payload.lstrip()[:1] in ("{", "["):
            data = payload.encode()  # the payload as a JSON-encoded string
        elif payload is doc:
            data = record.value  # the bare payload: its bytes as they came
        else:
            data = compact_json(payload)
        return opened_event(record, headers, event_id, event_type, data, attributes)


def _unquoted(text: str | None) -> str | None:
    """A header value; one written by a JsonConverter header converter is a JSON string."""
    if text is not None and len(text) >= 2 and text[0] == '"' == text[-1]:
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if isinstance(value, str) and value else None
    return text

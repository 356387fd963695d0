"""CloudEvents over Kafka, both content modes, recognised per record: the default envelope.

* Binary mode (what the relay writes): attributes in ``ce_*`` headers, the data as the
  record's value, its media type in ``content-type``.
* Structured mode (Dapr's default, Knative's KafkaSink option): ``content-type:
  application/cloudevents+json`` and the whole event as a JSON object in the value, its
  data in ``data`` (JSON, or a string for a non-JSON ``datacontenttype``) or ``data_base64``.
  A record without ``ce_id`` whose value is such an object (it names ``specversion``) is
  read so too when the producer did not set the header: it would be malformed otherwise.

A batch (``application/cloudevents-batch+json``) or another event format is a malformed
record with that reason: the Kafka binding defines neither.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from inbox.envelopes.base import (
    MAX_ID_CHARS,
    BuiltIn,
    Headers,
    check_id,
    compact_json,
    opened_event,
    undecoded,
    unreadable,
    utf8,
)
from inbox.event import InboxEvent, KafkaRecord

STRUCTURED = b"application/cloudevents"  # any content type starting so is not binary mode
JSON_FORMAT = "application/cloudevents+json"
_NOT_ATTRIBUTES = ("data", "data_base64")


class CloudEvents(BuiltIn):
    """The default envelope (see the module docstring)."""

    name = "cloudevents"

    def decode(self, record: KafkaRecord) -> InboxEvent:
        return decode(record)


# ---------------------------------------------------------------------------------------
# HOT PATH: every record of a consumer on the default envelope goes through this function.
# One pass over the headers, which keeps aiokafka's (name, bytes) pairs as they are (only
# odd values, a null header or a buffer, are copied); a binary-mode record costs what it
# did before structured mode was recognised (one more comparison per header).
def decode(record: KafkaRecord) -> InboxEvent:
    raw_headers = record.headers
    raw_id = raw_type = content_type = None
    exact = True
    for item in raw_headers:  # the last of a repeated header wins
        name, raw = item
        if type(raw) is not bytes or type(item) is not tuple:
            exact = False
            raw = bytes(raw or b"")
        if name == "ce_id":
            raw_id = raw
        elif name == "ce_type":
            raw_type = raw
        elif name == "content-type":
            content_type = raw
    headers: Headers = (
        tuple(raw_headers) if exact else tuple((n, bytes(v or b"")) for n, v in raw_headers)
    )
    # A header name that is not UTF-8 comes in a tuple subclass (outbox/kafka/client.py
    # UndecodedHeader): found on the copying path only, at no cost to the usual one.
    if not exact and (problem := undecoded(raw_headers)) is not None:
        event_type = None if raw_type is None else utf8(raw_type)
        return unreadable(record, headers, problem, event_type)
    if (
        content_type is not None
        and content_type != b"application/json"  # the usual binary mode: one cheap test
        and content_type[:23].lower() == STRUCTURED
    ):
        return _structured(record, headers, content_type)
    event_id = None if raw_id is None else utf8(raw_id)
    event_type = None if raw_type is None else utf8(raw_type)
    if event_id is None:
        value = record.value
        if raw_id is None and value is not None and b'"specversion"' in value:
            return _structured(record, headers, JSON_FORMAT.encode())  # header left out
        return unreadable(record, headers, "missing or invalid ce_id header", event_type)
    if len(event_id) > MAX_ID_CHARS:
        return unreadable(record, headers, "ce_id header longer than 255 characters", event_type)
    if event_type is None:
        return unreadable(record, headers, "missing or invalid ce_type header")
    # Strict UTF-8 decoding let no lone surrogate through; a NUL is valid UTF-8, and no
    # text column takes it.
    if "\x00" in event_id:
        return unreadable(record, headers, "ce_id header holds a NUL byte", event_type)
    if "\x00" in event_type:
        return unreadable(record, headers, "ce_type header holds a NUL byte", event_type)
    # Every field set at once: a frozen dataclass's __init__ sets them one by one through
    # object.__setattr__, half of this function's cost (a unit test checks every field).
    event = object.__new__(InboxEvent)
    event.__dict__.update(
        event_id=event_id,
        event_type=event_type,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        headers=headers,
        malformed=None,
        timestamp_ms=record.timestamp,
        received_value=None,
        attributes=None,
    )
    return event


def _structured(record: KafkaRecord, headers: Headers, content_type: bytes) -> InboxEvent:
    media = content_type.decode("latin-1").partition(";")[0].strip().lower()
    if media.startswith("application/cloudevents-batch"):
        return unreadable(
            record,
            headers,
            f"cloudevents: batch content mode ({media}) is not defined for Kafka; "
            "send one event per record",
        )
    if media != JSON_FORMAT:
        return unreadable(
            record,
            headers,
            f"cloudevents: structured mode in {media!r} is not supported (only {JSON_FORMAT})",
        )
    problem, parts = _read(record.value)
    if problem is not None:
        return unreadable(record, headers, f"cloudevents: structured event {problem}")
    event_id, event_type, payload, attributes = parts
    return opened_event(record, headers, event_id, event_type, payload, attributes)


_Parts = tuple[str, str, bytes | None, tuple[tuple[str, str], ...]]
_NONE: _Parts = ("", "", None, ())


def _read(value: bytes | None) -> tuple[str | None, _Parts]:
    """(reason it cannot be read, or None; (id, type, payload, attributes))."""
    if value is None:
        return "has no value (a tombstone)", _NONE
    try:
        doc = json.loads(value)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        return f"is not JSON ({exc})", _NONE
    if not isinstance(doc, dict):
        return f"is a JSON {type(doc).__name__}, not an object", _NONE
    version = doc.get("specversion")
    if not isinstance(version, str) or not version.startswith("1."):
        return f"has specversion {version!r:.40}, not 1.x", _NONE
    event_id, event_type = doc.get("id"), doc.get("type")
    if not isinstance(event_id, str) or not event_id:
        return "has no id (a non-empty string)", _NONE
    if (problem := check_id(event_id, "its id")) is not None:
        return f"has {problem.removeprefix('its ')}", _NONE
    if not isinstance(event_type, str) or not event_type:
        return "has no type (a non-empty string)", _NONE
    content_type = doc.get("datacontenttype")
    if content_type is not None and not isinstance(content_type, str):
        return "has a datacontenttype that is not a string", _NONE
    payload: bytes | None = None
    if "data" in doc and "data_base64" in doc:
        return "has both data and data_base64", _NONE
    if "data_base64" in doc:
        encoded = doc["data_base64"]
        try:
            payload = base64.b64decode(encoded, validate=True) if encoded is not None else None
        except (binascii.Error, TypeError, ValueError):
            return "has a data_base64 that is not base64", _NONE
    elif "data" in doc:
        data = doc["data"]
        if isinstance(data, str) and not _is_json(content_type):
            payload = data.encode()  # text data, e.g. text/plain or application/xml
        elif data is not None:
            payload = compact_json(data)
            content_type = content_type or "application/json"
    attributes = tuple(
        (name, text)
        for name, raw in doc.items()
        if name not in _NOT_ATTRIBUTES and name != "datacontenttype"
        if (text := _attribute_text(raw)) is not None
    )
    if content_type is not None:
        attributes += (("datacontenttype", content_type),)
    return None, (event_id, event_type, payload, attributes)


def _is_json(content_type: str | None) -> bool:
    """Whether data of this media type is stored as a JSON value (the JSON event format:
    an absent datacontenttype means JSON)."""
    if content_type is None:
        return True
    media = content_type.partition(";")[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")


def _attribute_text(raw: Any) -> str | None:
    """An attribute's canonical string form (CloudEvents types); null means absent."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        return "true" if raw else "false"
    if isinstance(raw, str):
        return raw
    if isinstance(raw, int | float):
        return str(raw)
    return json.dumps(raw, separators=(",", ":"))

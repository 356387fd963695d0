"""An event on its way to Kafka, whichever source read it: a row the table source claimed,
or an event the WAL source decoded from a logical-decoding message.

:data:`Event` is one tuple type for both, its fields named by the constants below (the
claim returns its columns in this order: relay/sources/table/store.py). Events stay plain
tuples rather than named tuples: a named tuple built per event costs several times a
tuple's construction (docs/performance/relay.md), work added to every event on the relay's
hottest paths (the claim's rows come from psycopg as tuples; the WAL decoder builds one per
event). So code reads an
event by index with these constants, which the type checker resolves to each field's type.
"""

from __future__ import annotations

import json
import uuid
from typing import Final

from outbox.text import storable, unstorable

# The fields, in order.
ID: Final = 0  # the outbox row's id; a WAL event gets one only when it moves to failed
LANE: Final = 1  # its ordering lane (likewise)
TOPIC: Final = 2
KEY: Final = 3  # None: keyless
PAYLOAD: Final = 4  # None: a tombstone
CE_ID: Final = 5  # the event id (CloudEvents ``id``), as text
EVENT_TYPE: Final = 6
SOURCE: Final = 7  # CloudEvents ``source``
CONTENT_TYPE: Final = 8  # None for a tombstone
HEADERS: Final = 9  # the user's headers as JSON text ("{}": none)
CE_TIME: Final = 10  # when it was created, as CloudEvents ``time`` text
ATTEMPTS: Final = 11  # Kafka refusals so far (the table's column; 0 for a WAL event)
FINGERPRINT: Final = 12  # the producer's fingerprint (b"" for a WAL event until it fails)

FIELDS: Final = (
    "id",
    "lane",
    "topic",
    "key",
    "payload",
    "event_id",
    "event_type",
    "source",
    "content_type",
    "headers",
    "ce_time",
    "attempts",
    "fingerprint",
)

Event = tuple[
    int, int, str, bytes | None, bytes | None, str, str, str, str | None, str, str, int, bytes
]


def payload_bytes(event: Event) -> int:
    """An event's payload size, as the claim's byte budget counts it (a tombstone counts 0,
    in SQL as here)."""
    payload = event[PAYLOAD]
    return len(payload) if payload is not None else 0


def with_identity(event: Event, id: int, lane: int, fingerprint: bytes) -> Event:
    """``event`` with the outbox identity a failed-table row needs (a WAL event has none
    until it fails): a new id, its lane and its fingerprint."""
    return (
        id,
        lane,
        event[TOPIC],
        event[KEY],
        event[PAYLOAD],
        event[CE_ID],
        event[EVENT_TYPE],
        event[SOURCE],
        event[CONTENT_TYPE],
        event[HEADERS],
        event[CE_TIME],
        event[ATTEMPTS],
        fingerprint,
    )


def storable_event(event: Event) -> tuple[Event, bool]:
    """``event`` with what PostgreSQL's ``text`` and ``jsonb`` refuse escaped (``\\x00`` for a
    NUL, as outbox/text.py does), and whether anything was: for the failed table, which
    must take any event Kafka refused. A table-source event came out of those columns; a
    WAL event was decoded from bytes, which a producer writing the message itself (not
    through ``publish``, which refuses a NUL) may fill with anything. Not reversible: the
    failed row keeps the escaped text (its payload and key are bytes, kept exactly)."""
    fields = (event[TOPIC], event[EVENT_TYPE], event[SOURCE], event[CONTENT_TYPE] or "")
    headers = event[HEADERS]
    clean_headers = unstorable(headers, "headers") is None and "\\u0000" not in headers
    if clean_headers and all(unstorable(f, "") is None for f in fields):
        return event, False
    if not clean_headers:
        # JSON text: escape inside the parsed names and values (a "\u0000" escape is as
        # unstorable to jsonb as the character), never in the JSON syntax itself.
        try:
            parsed = json.loads(headers)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            headers = json.dumps(
                {storable(k): storable(v) if isinstance(v, str) else v for k, v in parsed.items()},
                ensure_ascii=False,
            )
        else:  # not the JSON object publish writes: kept as one JSON string
            headers = json.dumps(storable(headers), ensure_ascii=False)
    content_type = event[CONTENT_TYPE]
    return (
        event[ID],
        event[LANE],
        storable(event[TOPIC]),
        event[KEY],
        event[PAYLOAD],
        event[CE_ID],
        storable(event[EVENT_TYPE]),
        storable(event[SOURCE]),
        None if content_type is None else storable(content_type),
        headers,
        event[CE_TIME],
        event[ATTEMPTS],
        event[FINGERPRINT],
    ), True


# A WAL message under the outbox prefix that does not decode, kept in the failed table as
# an event of its own (relay/sources/wal/settling.py): its whole content is the payload, and
# these mark it (no Kafka topic may hold parentheses or spaces, so none is confused with
# one). `outbox failed retry` emits such a row's payload again as it is (relay/failed.py).
QUARANTINE_TOPIC: Final = "(undecodable WAL message)"
QUARANTINE_TYPE: Final = "outbox.wal.undecodable"
QUARANTINE_CONTENT_TYPE: Final = "application/vnd.outbox.wal-message"


def quarantined(content: bytes, lsn: str, ce_time: str) -> Event:
    """The event that keeps an undecodable message at ``lsn``: its id derived from the LSN,
    so that the message read again (after a restart before the slot moved past it) updates
    the same row."""
    event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"outbox-wal-message:{lsn}")
    return (
        0,
        0,
        QUARANTINE_TOPIC,
        None,
        content,
        str(event_id),
        QUARANTINE_TYPE,
        f"wal:{lsn}",
        QUARANTINE_CONTENT_TYPE,
        "{}",
        ce_time,
        0,
        b"",
    )

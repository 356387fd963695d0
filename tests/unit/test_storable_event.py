"""What the failed table cannot hold as text is escaped, not a crash loop (issue 51): a WAL
event decoded from a message written with ``pg_logical_emit_message`` directly may carry a
NUL (or a ``\\u0000`` JSON escape) that PostgreSQL's text and jsonb refuse."""

from __future__ import annotations

import json

from relay.event import CONTENT_TYPE, EVENT_TYPE, HEADERS, KEY, PAYLOAD, SOURCE, Event
from relay.event import storable_event as storable

CLEAN: Event = (
    0, 0, "orders", b"k\x00ey", b"\x00pay", "0b0e", "order.created", "svc", "application/json",
    '{"a": "b"}', "2026-12-03T00:00:00Z", 0, b"",
)  # fmt: skip


def _with(**fields: object) -> Event:
    index = {"event_type": EVENT_TYPE, "source": SOURCE, "headers": HEADERS}
    event = list(CLEAN)
    for name, value in fields.items():
        event[index[name]] = value
    return tuple(event)  # type: ignore[return-value]


def test_a_clean_event_is_the_same_object() -> None:
    kept, escaped = storable(CLEAN)
    assert kept is CLEAN and not escaped


def test_a_nul_in_type_source_or_header_is_escaped_and_bytes_kept_exactly() -> None:
    event = _with(
        event_type="order\x00created", source="s\x00", headers=json.dumps({"h\x00": "v\x00"})
    )
    assert "\\u0000" in event[HEADERS]  # json.dumps writes the escape jsonb refuses
    kept, escaped = storable(event)
    assert escaped
    assert kept[EVENT_TYPE] == "order\\x00created" and kept[SOURCE] == "s\\x00"
    assert json.loads(kept[HEADERS]) == {"h\\x00": "v\\x00"}
    assert "\\u0000" not in kept[HEADERS] and "\x00" not in kept[HEADERS]
    assert (kept[KEY], kept[PAYLOAD], kept[CONTENT_TYPE]) == (b"k\x00ey", b"\x00pay", CLEAN[8])


def test_headers_that_are_not_a_json_object_are_kept_as_one_json_string() -> None:
    kept, escaped = storable(_with(headers="not json \x00"))
    assert escaped and json.loads(kept[HEADERS]) == "not json \\x00"

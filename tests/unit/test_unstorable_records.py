"""Records whose id or type PostgreSQL cannot store (a NUL, a lone surrogate) are malformed
under their position, in every envelope, and what the inbox records of them is text a
column can hold; the bytes stay as they came (no services)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inbox import failures
from inbox.envelopes import Debezium, Generic, Header, Opened, Pointer, resolve
from inbox.event import InboxEvent, KafkaRecord
from outbox.text import unstorable
from tests.support.records import Rec

CE = {"ce_specversion": b"1.0", "ce_source": b"urn:x", "content-type": b"application/json"}


def binary(**headers: bytes) -> Rec:
    merged = {**CE, "ce_id": b"e-1", "ce_type": b"t", **headers}
    return Rec(value=b"{}", headers=tuple(merged.items()))


def structured(**doc: Any) -> Rec:
    body = {"specversion": "1.0", "id": "e-1", "type": "t", "source": "urn:x", **doc}
    return Rec(
        value=json.dumps(body).encode(),
        headers=(("content-type", b"application/cloudevents+json"),),
    )


def assert_storable(event: InboxEvent) -> None:
    for text in (event.event_id, event.event_type, event.malformed):
        if text is not None:
            assert unstorable(text, "x") is None, text


CASES = {
    "binary ce_id NUL": ("cloudevents", binary(ce_id=b"a\x00b")),
    "binary ce_type NUL": ("cloudevents", binary(ce_type=b"order\x00created")),
    "structured id NUL": ("cloudevents", structured(id="a\x00b")),
    "structured id surrogate": ("cloudevents", structured(id="a\ud800")),
    "structured type NUL": ("cloudevents", structured(type="t\x00")),
    "structured type surrogate": ("cloudevents", structured(type="\udfff")),
    "debezium id NUL": ("debezium", Rec(value=b"{}", headers=(("id", b"a\x00"),))),
    "debezium quoted id escape": (
        "debezium",
        Rec(value=b"{}", headers=(("id", b'"a\\u0000"'),)),
    ),
    "debezium type NUL": (
        Debezium(type_header="eventType"),
        Rec(value=b"{}", headers=(("id", b"e-1"), ("eventType", b"\x00"))),
    ),
    "generic pointer id surrogate": (
        Generic(id=Pointer("/id")),
        Rec(value=b'{"id": "\\ud800"}'),
    ),
    "generic header type NUL": (
        Generic(id=Header("id"), type=Header("type")),
        Rec(headers=(("id", b"e"), ("type", b"a\x00"))),
    ),
}


@pytest.mark.parametrize(("envelope", "record"), CASES.values(), ids=CASES.keys())
def test_unstorable_ids_and_types_are_malformed_under_their_position(
    envelope: Any, record: Rec
) -> None:
    event = resolve(envelope).decode(record)
    assert event.malformed is not None
    assert "NUL" in event.malformed or "surrogate" in event.malformed
    assert event.event_id == "t:2:7"
    assert event.headers == record.headers and event.value == record.value
    assert_storable(event)


def test_a_users_envelope_returning_a_nul_id_is_malformed() -> None:
    def envelope(record: KafkaRecord) -> Opened:
        return Opened(event_id="x\x00", payload=record.value, event_type="t\x00")

    event = resolve(envelope).decode(Rec())
    assert event.malformed is not None and "NUL" in event.malformed
    assert event.event_type == "t\\x00"  # escaped, as the dead letter's type column holds it
    assert_storable(event)


def test_a_missing_id_keeps_an_unstorable_type_escaped() -> None:
    record = Rec(headers=(("ce_type", b"a\x00b"),), value=b"{}")
    event = resolve("cloudevents").decode(record)
    assert event.malformed == "missing or invalid ce_id header"
    assert event.event_type == "a\\x00b"


def test_nul_in_other_headers_and_the_key_is_a_normal_event() -> None:
    record = binary(ce_source=b"urn:\x00", h=b"\x00\xff")
    record.key = b"k\x00"
    record.headers += (("name\x00", b"v"),)
    event = resolve("cloudevents").decode(record)
    assert event.malformed is None and event.event_id == "e-1"
    assert event.source == "urn:\x00" and event.key == b"k\x00"


def test_failures_record_text_a_column_can_hold() -> None:
    failure = failures.classify(ValueError("bad \x00 byte \ud800 here"), 200)
    assert failure.message == "bad \\x00 byte \\ud800 here"
    failure.text().encode()  # a dead-letter header: UTF-8
    assert "\\x00" in failures.malformed("why \x00", 200).message

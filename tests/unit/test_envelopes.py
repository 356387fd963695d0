"""Envelopes read records of producers we did not write: pure decoding, no services.

Records are built the way their producers build them — the CloudEvents SDK's Kafka binding
for both content modes, the shapes of Debezium's outbox event router — and read back."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from pydantic import BaseModel

import inbox
from inbox.envelopes import (
    CloudEvents,
    Debezium,
    Generic,
    Header,
    Opened,
    Pointer,
    Position,
    resolve,
)
from inbox.envelopes.base import EVENT_ID_HEADER
from inbox.errors import EnvelopeError, Unreadable
from inbox.event import InboxEvent
from outbox.kafka.client import UndecodedHeader
from tests.support.records import Rec


def rec(value: bytes | None, headers: dict[str, bytes] | None = None, **kw: Any) -> Rec:
    return Rec(value=value, headers=tuple((headers or {}).items()), **kw)


def sdk_event(data: Any, **attributes: Any) -> CloudEvent:
    base = {"id": "e-1", "type": "order.created", "source": "urn:shop", "specversion": "1.0"}
    return CloudEvent(attributes={**base, **attributes}, data=data)


def sdk_record(message: ce_kafka.KafkaMessage) -> Rec:
    key = message.key.encode() if isinstance(message.key, str) else message.key
    return rec(message.value, dict(message.headers), key=key)


def decode(envelope: Any, record: Rec) -> InboxEvent:
    return resolve(envelope).decode(record)


# ------------------------------------------------------------------ CloudEvents


def test_cloudevents_sdk_binary_mode_is_read_from_headers() -> None:
    event = sdk_event({"n": 1}, sequence="42", datacontenttype="application/json")
    e = decode("cloudevents", sdk_record(ce_kafka.to_binary(event, JSONFormat())))
    assert (e.event_id, e.event_type, e.source, e.malformed) == (
        "e-1",
        "order.created",
        "urn:shop",
        None,
    )
    assert json.loads(e.value or b"") == {"n": 1} and e.received_value is None
    assert e.sequence == 42 and e.content_type == "application/json"


def test_cloudevents_sdk_structured_mode_gives_the_data_and_keeps_the_record() -> None:
    event = sdk_event({"n": 1, "s": "é"}, sequence="00000000000000000042", subject="o-1")
    record = sdk_record(ce_kafka.to_structured(event, JSONFormat()))
    e = decode("cloudevents", record)
    assert (e.event_id, e.event_type, e.malformed) == ("e-1", "order.created", None)
    assert json.loads(e.value or b"") == {"n": 1, "s": "é"}
    assert e.record_value == record.value  # what a dead letter carries: the whole event
    assert (e.source, e.attribute("subject"), e.sequence) == ("urn:shop", "o-1", 42)
    assert e.content_type == "application/json" and e.time is not None


def test_a_structured_events_own_trace_context_continues_the_trace() -> None:
    from inbox.tracing import carrier

    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    doc = {"specversion": "1.0", "id": "x", "type": "t", "traceparent": parent, "data": {}}
    headers = {"content-type": b"application/cloudevents+json", "traceparent": b"00-other"}
    e = decode("cloudevents", rec(json.dumps(doc).encode(), headers))
    assert dict(carrier(e))["traceparent"] == parent.encode()  # the event's own wins
    binary = decode("cloudevents", rec(b"{}", {"ce_id": b"i", "ce_type": b"t"}))
    assert carrier(binary) is binary.headers


def test_structured_mode_data_base64_and_text_data() -> None:
    binary = sdk_event(b"\x00\x01", datacontenttype="application/octet-stream")
    e = decode("cloudevents", sdk_record(ce_kafka.to_structured(binary, JSONFormat())))
    assert e.value == b"\x00\x01" and e.content_type == "application/octet-stream"
    doc = {
        "specversion": "1.0",
        "id": "x",
        "type": "t",
        "source": "s",
        "datacontenttype": "text/plain",
        "data": "hello",
    }
    e = decode(
        "cloudevents",
        rec(
            json.dumps(doc).encode(),
            {"content-type": b"application/cloudevents+json; charset=utf-8"},
        ),
    )
    assert e.value == b"hello" and e.malformed is None


def test_structured_mode_is_recognised_per_record_case_insensitively() -> None:
    doc = {"specversion": "1.0", "id": "x", "type": "t", "source": "s", "data": {"a": 1}}
    e = decode(
        "cloudevents",
        rec(json.dumps(doc).encode(), {"content-type": b"Application/CloudEvents+JSON"}),
    )
    assert e.event_id == "x" and e.value == b'{"a":1}'


def test_a_structured_event_without_its_content_type_header_is_still_read() -> None:
    doc = {"specversion": "1.0", "id": "x", "type": "t", "source": "s", "data": {"a": 1}}
    e = decode("cloudevents", rec(json.dumps(doc).encode(), {"content-type": b"application/json"}))
    assert (e.event_id, e.event_type, e.value, e.malformed) == ("x", "t", b'{"a":1}', None)
    # Without specversion it is no CloudEvent at all: the binary mode's reason.
    e = decode("cloudevents", rec(b'{"id": "x", "type": "t"}'))
    assert e.malformed == "missing or invalid ce_id header"
    e = decode("cloudevents", rec(b'{"specversion": "1.0", "type": "t"}'))
    assert e.malformed == "cloudevents: structured event has no id (a non-empty string)"


@pytest.mark.parametrize(
    ("value", "content_type", "reason"),
    [
        (b"[]", b"application/cloudevents-batch+json", "batch content mode"),
        (b"{}", b"application/cloudevents+avro", "not supported"),
        (None, b"application/cloudevents+json", "no value"),
        (b"{not json", b"application/cloudevents+json", "not JSON"),
        (b"[1]", b"application/cloudevents+json", "not an object"),
        (b'{"id": "x", "type": "t"}', b"application/cloudevents+json", "specversion"),
        (b'{"specversion": "1.0", "type": "t"}', b"application/cloudevents+json", "no id"),
        (b'{"specversion": "1.0", "id": "x"}', b"application/cloudevents+json", "no type"),
        (
            json.dumps({"specversion": "1.0", "id": "x" * 256, "type": "t"}).encode(),
            b"application/cloudevents+json",
            "longer than 255",
        ),
        (
            b'{"specversion": "1.0", "id": "x", "type": "t", "data": 1, "data_base64": "AA=="}',
            b"application/cloudevents+json",
            "both data",
        ),
        (
            b'{"specversion": "1.0", "id": "x", "type": "t", "data_base64": "%%%"}',
            b"application/cloudevents+json",
            "not base64",
        ),
    ],
)
def test_unreadable_structured_events_are_malformed_with_a_reason(
    value: bytes | None, content_type: bytes, reason: str
) -> None:
    e = decode("cloudevents", rec(value, {"content-type": content_type}))
    assert (
        e.malformed is not None and reason in e.malformed and e.malformed.startswith("cloudevents")
    )
    assert e.event_id == "t:2:7" and e.record_value == value


# ------------------------------------------------------------------ Debezium

PAYLOAD = {"orderId": 1, "lineItems": [{"item": "Debezium in Action", "quantity": 2}]}
STRING_SCHEMA = {"type": "string", "optional": True}


@pytest.mark.parametrize(
    "value",
    [
        json.dumps(PAYLOAD),  # bare payload (expand.json.payload, or a jsonb column)
        json.dumps(json.dumps(PAYLOAD)),  # the payload as a JSON-encoded string
        json.dumps({"schema": STRING_SCHEMA, "payload": json.dumps(PAYLOAD)}),  # JsonConverter
        json.dumps({"schema": {"type": "struct"}, "payload": PAYLOAD}),
    ],
)
def test_debezium_outbox_router_values_in_every_shape(value: str) -> None:
    e = decode(
        "debezium", rec(value.encode(), {"id": b"4d47e190-0402-4048-bc2c-89dd54343cdc"}, key=b"1")
    )
    assert e.malformed is None and e.event_id == "4d47e190-0402-4048-bc2c-89dd54343cdc"
    assert e.event_type is None and e.json() == PAYLOAD and e.content_type == "application/json"
    assert e.record_value == value.encode()


def test_debezium_type_and_sequence_where_the_router_places_them() -> None:
    headers = {
        "id": b'"abc"',
        "eventType": b"OrderCreated",
        "sequence": b"7",
    }  # JSON header converter quotes
    e = decode(Debezium(type_header="eventType", sequence_header="sequence"), rec(b"{}", headers))
    assert (e.event_id, e.event_type, e.sequence) == ("abc", "OrderCreated", 7)
    envelope = json.dumps(
        {"schema": {}, "payload": {"payload": json.dumps(PAYLOAD), "eventType": "OrderCreated"}}
    )
    e = decode(Debezium(type_field="eventType"), rec(envelope.encode(), {"id": b"abc"}))
    assert e.event_type == "OrderCreated" and e.json() == PAYLOAD


@pytest.mark.parametrize(
    ("envelope", "value", "headers", "reason"),
    [
        (Debezium(), b"{}", {}, "no 'id' header"),
        (Debezium(), b"{}", {"id": b""}, "no 'id' header"),
        (Debezium(), b"{oops", {"id": b"a"}, "not JSON"),
        (Debezium(type_header="eventType"), b"{}", {"id": b"a"}, "no 'eventType' header"),
        (
            Debezium(type_field="eventType"),
            b'{"x": 1}',
            {"id": b"a"},
            "not an object with a payload",
        ),
        (Debezium(type_field="eventType"), None, {"id": b"a"}, "tombstone"),
    ],
)
def test_unreadable_debezium_records(
    envelope: Debezium, value: bytes | None, headers: dict[str, bytes], reason: str
) -> None:
    e = decode(envelope, rec(value, headers))
    assert e.malformed is not None and reason in e.malformed and e.event_id == "t:2:7"


def test_a_debezium_tombstone_with_an_id_is_an_event_without_data() -> None:
    e = decode("debezium", rec(None, {"id": b"a"}))
    assert (e.event_id, e.value, e.malformed) == ("a", None, None)


# ------------------------------------------------------------------ generic


def test_generic_reads_named_headers_and_json_pointers() -> None:
    e = decode(
        Generic(id=Header("message-id"), type=Header("message-type")),
        rec(b'{"a": 1}', {"message-id": b"m1", "message-type": b"t"}),
    )
    assert (e.event_id, e.event_type, e.value) == ("m1", "t", b'{"a": 1}')
    body = {"meta": {"id": 17, "type": "order.paid", "v": 3, "a/b": "x"}, "data": {"n": 1}}
    envelope = Generic(
        id=Pointer("/meta/id"),
        type=Pointer("/meta/type"),
        sequence=Pointer("/meta/v"),
        payload=Pointer("/data"),
    )
    e = decode(envelope, rec(json.dumps(body).encode()))
    assert (e.event_id, e.event_type, e.sequence, e.json()) == ("17", "order.paid", 3, {"n": 1})
    assert e.record_value == json.dumps(body).encode() and e.content_type == "application/json"
    assert (
        Pointer("/meta/a~1b").find(body) == "x" and Pointer("/items/1").find({"items": [0, 5]}) == 5
    )
    assert not e.malformed


def test_generic_refuses_what_it_cannot_read() -> None:
    envelope = Generic(id=Pointer("/meta/id"), type=Pointer("/meta/type"))
    for value, reason in [
        (b'{"meta": {"type": "t"}}', "no event id at /meta/id"),
        (b'{"meta": {"id": true, "type": "t"}}', "no event id"),
        (b'{"meta": {"id": "x"}}', "no event type at /meta/type"),
        (b"not json", "not JSON"),
        (None, "tombstone"),
    ]:
        e = decode(envelope, rec(value))
        assert e.malformed is not None and reason in e.malformed, (value, e.malformed)
    with pytest.raises(EnvelopeError, match="start with"):
        Pointer("meta/id")
    with pytest.raises(EnvelopeError, match="~0"):
        Pointer("/a~2")
    with pytest.raises(EnvelopeError, match="takes"):
        Generic(id="message-id")  # type: ignore[arg-type]


def test_position_ids_and_their_replay() -> None:
    e = decode("position", rec(b"{}", offset=9))
    assert (e.event_id, e.event_type, e.malformed) == ("t:2:9", None, None)
    # `outbox dlq replay` produced it elsewhere: the dead letter's id is kept ...
    replayed = rec(b"{}", {EVENT_ID_HEADER: b"t:2:9"}, partition=0, offset=50)
    assert decode(Generic(id=Position()), replayed).event_id == "t:2:9"
    # ... and an unreadable record's replay finds its dead letter again.
    assert decode("cloudevents", replayed).event_id == "t:2:9"
    # A producer id or another topic's position is not a position of this record.
    for other in (b"4d47e190", b"u:2:9", b"t:x:9"):
        assert decode("position", rec(b"{}", {EVENT_ID_HEADER: other})).event_id == "t:2:7"


# ------------------------------------------------------------------ a user's own


def test_a_users_envelope_by_module_attr_function_or_class() -> None:
    record = rec(b'{"n": 1}', {"x-msg-id": b"m-1", "x-kind": b"k"})
    for spec in ("tests.support.envelopes:legacy", "tests.support.envelopes:Legacy"):
        e = decode(spec, record)
        assert (e.event_id, e.event_type, e.value, e.source) == (
            "m-1",
            "k",
            b'{"n": 1}',
            "urn:legacy",
        )
        assert e.content_type == "application/json"
    assert resolve("tests.support.envelopes:Legacy").typed is True
    assert resolve("tests.support.envelopes:legacy").typed is None


def test_a_users_envelope_that_cannot_read_a_record_makes_it_malformed() -> None:
    e = decode("tests.support.envelopes:legacy", rec(b"{}"))
    assert e.malformed == "tests.support.envelopes:legacy: no x-msg-id header"
    e = decode("tests.support.envelopes:crashes", rec(None))
    assert e.malformed is not None and "AttributeError" in e.malformed

    class Secret(BaseModel):
        n: int

    def validating(record: Any) -> Opened:
        Secret.model_validate_json(record.value)
        raise AssertionError

    e = decode(validating, rec(b'{"n": "hunter2"}'))
    assert (
        e.malformed is not None
        and "ValidationError" in e.malformed
        and "hunter2" not in e.malformed
    )


def test_a_users_envelope_returning_garbage_is_a_typed_error() -> None:
    with pytest.raises(
        EnvelopeError, match=r"returned dict for t\[2\]@7, not an inbox.envelopes.Opened"
    ):
        decode("tests.support.envelopes:garbage", rec(b"{}"))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("protobuf", "unknown envelope 'protobuf'"),
        ("tests.support.nowhere:x", "cannot import"),
        ("tests.support.envelopes:missing", "no attribute"),
        ("tests.support.envelopes:NOT_AN_ENVELOPE", "is not an envelope"),
        (Opened, "cannot make one without arguments"),
    ],
)
def test_bad_envelope_declarations_are_refused(spec: Any, match: str) -> None:
    with pytest.raises(EnvelopeError, match=match):
        inbox.Consumer(name="c", topics=["t"], envelope=spec)


def test_opened_values_are_checked() -> None:
    for bad in (
        {"event_id": ""},
        {"event_id": 5},
        {"event_id": "x" * 256},
        {"payload": "text"},
        {"event_type": ""},
    ):
        with pytest.raises(ValueError):
            Opened(**{"event_id": "x", "payload": b"", **bad})


def test_a_built_in_opens_for_a_users_envelope_built_on_it() -> None:
    event = sdk_event({"n": 1}, subject="s-1")
    opened = CloudEvents().open(sdk_record(ce_kafka.to_binary(event, JSONFormat())))
    assert (opened.event_id, opened.event_type, opened.metadata["subject"]) == (
        "e-1",
        "order.created",
        "s-1",
    )
    with pytest.raises(Unreadable, match="no 'id' header"):
        Debezium().open(rec(b"{}"))
    assert Debezium().open(rec(b'"{\\"a\\": 1}"', {"id": b"i"})).payload == b'{"a": 1}'


@pytest.mark.parametrize(
    ("spec", "headers", "outcome"),
    [
        ("cloudevents", {"content-type": b"application/cloudevents+json"}, "no value"),
        ("cloudevents", {"ce_id": b"i", "ce_type": b"t"}, None),  # binary: an event without data
        ("debezium", {"id": b"i"}, None),
        ("position", {}, None),
        (Generic(id=Pointer("/id")), {}, "tombstone"),
        ("tests.support.envelopes:legacy", {"x-msg-id": b"i"}, None),
    ],
)
def test_tombstones_are_events_without_data_or_malformed_never_a_crash(
    spec: Any, headers: dict[str, bytes], outcome: str | None
) -> None:
    e = decode(spec, rec(None, headers))
    if outcome is None:
        assert e.malformed is None and e.value is None
    else:
        assert e.malformed is not None and outcome in e.malformed


def test_binary_mode_passes_the_value_through_untouched() -> None:
    raw = base64.b64encode(b"x")
    e = decode("cloudevents", rec(raw, {"ce_id": b"i", "ce_type": b"t"}))
    assert e.value == raw and e.received_value is None and e.attributes is None


# ------------------------------------------------- a header name that is not UTF-8


@pytest.mark.parametrize(
    ("envelope", "headers", "value"),
    [
        ("cloudevents", {"ce_id": b"e-1", "ce_type": b"t"}, b"{}"),
        ("cloudevents", {"content-type": b"application/cloudevents+json"}, b"{}"),
        ("debezium", {"id": b"e-1"}, b'{"a": 1}'),
        (Generic(id=Header("message-id")), {"message-id": b"e-1"}, b"{}"),
        (lambda r: Opened(event_id="e-1", payload=r.value), {}, b"{}"),
    ],
    ids=["binary", "structured", "debezium", "generic", "users"],
)
def test_a_header_name_not_utf8_makes_the_record_malformed_whatever_the_envelope(
    envelope: Any, headers: dict[str, bytes], value: bytes
) -> None:
    # The Kafka client hands such a header as an UndecodedHeader, its name escaped: read as
    # a name, it would be one the producer did not send.
    if envelope == "cloudevents" and "content-type" in headers:
        value = json.dumps(
            {"id": "e-1", "type": "t", "source": "urn:x", "specversion": "1.0"}
        ).encode()
    bad = UndecodedHeader(("user-\\xffname", b"v\xff"))
    record = Rec(value=value, headers=(*headers.items(), bad))
    e = decode(envelope, record)
    assert e.malformed == "header name user-\\xffname is not UTF-8 (its bytes shown escaped, \\xNN)"
    assert e.event_id == "t:2:7"  # its position: the dead letter is deduplicated by it
    assert e.headers[-1] == ("user-\\xffname", b"v\xff") and e.value == value
    # Without it, the same record is read.
    assert not decode(envelope, Rec(value=value, headers=tuple(headers.items()))).malformed

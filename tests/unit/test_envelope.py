"""Pure logic of turning messages into rows: encoding, lanes, ids, limits."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import BaseModel, ConfigDict

from outbox import (
    TOMBSTONE,
    Message,
    PayloadError,
    PayloadTooLarge,
    canonical_json,
    idempotency_key,
    uuid7,
)
from outbox.envelope import (
    JSON,
    OCTET_STREAM,
    Row,
    StoredEvent,
    encode_payload,
    lane_for,
    prepare,
    same_event,
)


class Order(BaseModel):
    id: int
    at: datetime


def _prep(**kw: object) -> object:
    base: dict[str, object] = {
        "topic": "orders",
        "event_type": "order.created",
        "payload": {"a": 1},
    }
    base.update(kw)
    return prepare(Message(**base), lanes=64, max_bytes=1_000, default_source="urn:test")  # type: ignore[arg-type]


def test_payload_encodings() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert encode_payload(Order(id=1, at=at)) == (b'{"id":1,"at":"2026-01-02T03:04:05Z"}', JSON)
    assert encode_payload({"b": [1, 2]}) == (b'{"b":[1,2]}', JSON)
    assert encode_payload([1, "x"]) == (b'[1,"x"]', JSON)
    assert encode_payload(b"\x00\x01") == (b"\x00\x01", OCTET_STREAM)
    assert encode_payload(bytearray(b"ab")) == (b"ab", OCTET_STREAM)
    with pytest.raises(PayloadError, match="payload must be"):
        encode_payload("a string")  # type: ignore[arg-type]


def test_lane_is_stable_and_in_range() -> None:
    eid = uuid.uuid4()
    lanes = {lane_for(f"key-{i}".encode(), eid, 64) for i in range(2000)}
    assert lanes == set(range(64)), "2000 keys should cover all 64 lanes"
    assert lane_for(b"customer-42", eid, 64) == lane_for(b"customer-42", uuid.uuid4(), 64)
    # Pinned value: the hash must never change between versions, or ordering breaks on upgrade.
    assert lane_for(b"customer-42", eid, 64) == 42


def test_keyless_events_spread_by_event_id() -> None:
    lanes = {lane_for(None, uuid.uuid4(), 16) for _ in range(500)}
    assert len(lanes) == 16


def test_uuid7_is_time_ordered_and_versioned() -> None:
    ids = [uuid7() for _ in range(1000)]
    assert all(u.version == 7 for u in ids)
    stamps = [u.int >> 80 for u in ids]
    assert stamps == sorted(stamps)


def test_prepare_row_fields() -> None:
    row = _prep(key="k1", headers={"traceparent": "00-abc-01"})
    assert row.key == b"k1" and row.source == "urn:test"
    assert json.loads(row.headers) == {"traceparent": "00-abc-01"}
    assert row.event_id.version == 7


def test_fingerprint_covers_topic_key_type_payload() -> None:
    eid = uuid.uuid4()
    base = _prep(event_id=eid, key="k").fingerprint
    assert _prep(event_id=eid, key="k").fingerprint == base
    assert _prep(event_id=eid, key="k2").fingerprint != base
    assert _prep(event_id=eid, key="k", topic="other").fingerprint != base
    assert _prep(event_id=eid, key="k", event_type="x").fingerprint != base
    assert _prep(event_id=eid, key="k", payload={"a": 2}).fingerprint != base


def _stored(row: Row, **kw: object) -> StoredEvent:
    fields: dict[str, object] = {
        "topic": row.topic,
        "key": row.key,
        "event_type": row.event_type,
        "content_type": row.content_type,
        "payload": row.payload,
    }
    fields.update(kw)
    return StoredEvent(**fields)  # type: ignore[arg-type]


def test_same_event_compares_json_payloads_by_their_canonical_form() -> None:
    row = _prep(key="k", payload={"b": {"y": "é", "x": [1, 2]}, "a": 1.0})
    assert isinstance(row, Row)
    assert same_event(row, _stored(row, payload=b'{"a":1,"b":{"x":[1,2],"y":"\\u00e9"}}'))
    assert not same_event(row, _stored(row, payload=b'{"a":1,"b":{"x":[2,1],"y":"\\u00e9"}}'))
    assert not same_event(row, _stored(row, payload=b'{"a":1,"b":{"x":[1,2],"y":"e"}}'))
    same = b'{"a":1,"b":{"x":[1,2],"y":"\\u00e9"}}'
    assert not same_event(row, _stored(row, payload=same, key=b"other"))
    assert not same_event(row, _stored(row, payload=same, topic="other"))
    assert not same_event(row, _stored(row, payload=same, event_type="other"))
    # Raw bytes are compared as bytes, even when they happen to be JSON.
    assert not same_event(row, _stored(row, payload=same, content_type=OCTET_STREAM))
    # No canonical form (an integer beyond 2**53, not JSON at all): the bytes decided.
    big = _prep(payload={"id": 2**60, "a": 1})
    assert isinstance(big, Row)
    assert not same_event(big, _stored(big, payload=b'{"a":1,"id":1152921504606846976}'))
    assert not same_event(row, _stored(row, payload=b"{not json"))


def test_size_limit_counts_key_payload_and_headers() -> None:
    _prep(payload=b"x" * 990, key="12345")
    with pytest.raises(PayloadTooLarge) as info:
        _prep(payload=b"x" * 990, key="12345", headers={"h": "123456"})
    assert info.value.size == 1002 and info.value.limit == 1000


@pytest.mark.parametrize(
    "bad",
    [
        {"headers": {"ce_type": "x"}},
        {"headers": {"Content-Type": "x"}},
        {"headers": {"h": 1}},
        {"key": 12},
        {"delay_seconds": -1},
        {"event_type": "x" * 256},
    ],
)
def test_bad_messages(bad: dict[str, object]) -> None:
    with pytest.raises(PayloadError):
        _prep(**bad)


def test_canonical_json_normalizes() -> None:
    assert (
        canonical_json({"b": 1.0, "a": Decimal("2.50"), "c": [True, None]})
        == b'{"a":2.5,"b":1,"c":[true,null]}'
    )
    assert canonical_json({"x": "é"}) == '{"x":"é"}'.encode()
    with pytest.raises(PayloadError):
        canonical_json({"x": float("nan")})


def test_idempotency_key_is_deterministic_and_intent_sensitive() -> None:
    a = idempotency_key("refund", "ch_1", payload={"amount": 500, "currency": "EUR"})
    assert a == idempotency_key("refund", "ch_1", payload={"currency": "EUR", "amount": 500.0})
    assert a != idempotency_key("refund", "ch_1", payload={"amount": 501, "currency": "EUR"})
    assert a != idempotency_key("refund", "ch_2", payload={"amount": 500, "currency": "EUR"})
    assert a.version == 8
    with pytest.raises(PayloadError):
        idempotency_key()
    with pytest.raises(PayloadError):
        idempotency_key("x", 1.5)  # type: ignore[arg-type]


class Line(BaseModel):
    sku: str
    price: float


class Basket(BaseModel):
    lines: list[Line]


class NullsAllowed(BaseModel):
    # The model's author chose how NaN is written: honoured, not looked into.
    model_config = ConfigDict(ser_json_inf_nan="null")
    price: float


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"price": NAN}, "$.price is NaN"),
        ({"price": INF}, "$.price is Infinity"),
        ({"price": -INF}, "$.price is -Infinity"),
        ({"order": {"total": {"gross": NAN}}}, "$.order.total.gross is NaN"),
        ([1, 2, INF], "$[2] is Infinity"),
        ({"items": [{"price": 1}, {"price": 2}, {"price": 3}, {"price": NAN}]}, "$.items[3].price"),
        ({"rows": [[0.5, (1.5, -INF)]]}, "$.rows[0][1][1] is -Infinity"),
        ({"odd key": NAN}, '$["odd key"] is NaN'),
        ({"amount": Decimal("NaN")}, "$.amount is NaN"),
        (Basket(lines=[Line(sku="a", price=1.0), Line(sku="b", price=NAN)]), "$.lines[1].price"),
        ({"basket": Basket(lines=[Line(sku="a", price=INF)])}, "$.basket.lines[0].price"),
    ],
)
def test_nan_and_infinity_are_refused_with_their_place(payload: object, where: str) -> None:
    with pytest.raises(PayloadError, match="no JSON representation") as info:
        _prep(payload=payload)
    assert f"payload {where}" in str(info.value)


def test_words_like_nan_in_strings_and_nulls_are_fine() -> None:
    payload = {"name": "NaN bread", "note": "Infinity pool", "gone": None, "ok": 1.5}
    row = _prep(payload=payload)
    assert isinstance(row, Row) and row.payload is not None
    assert json.loads(row.payload) == payload
    # A model that chose to write NaN as null keeps that choice.
    assert encode_payload(NullsAllowed(price=NAN)) == (b'{"price":null}', JSON)


def test_canonical_json_and_keys_name_the_place_too() -> None:
    with pytest.raises(PayloadError, match=r"value \$\.a\[1\] is NaN"):
        canonical_json({"a": [1, NAN]})
    with pytest.raises(PayloadError, match=r"payload \$\.amount is Infinity"):
        idempotency_key("refund", 1, payload={"amount": INF})


def test_a_tombstone_is_a_null_value_without_content_type() -> None:
    row = _prep(payload=TOMBSTONE, key="c-1")
    assert isinstance(row, Row)
    assert row.payload is None and row.content_type is None
    # Distinct from an empty payload, and in the same lane as the key's other events.
    assert row.fingerprint != _prep(payload=b"", key="c-1", event_id=row.event_id).fingerprint
    assert row.lane == _prep(payload={"a": 1}, key="c-1").lane
    with pytest.raises(PayloadError, match="needs a key"):
        _prep(payload=TOMBSTONE)
    with pytest.raises(PayloadError, match=r"payload=outbox\.TOMBSTONE"):
        _prep(payload=None, key="c-1")
    assert repr(TOMBSTONE) == "outbox.TOMBSTONE"
    # A stored tombstone is never "the same event" as a payload (and vice versa).
    json_row = _prep(payload={"a": 1}, key="c-1")
    assert not same_event(row, _stored(json_row))
    assert not same_event(json_row, _stored(row))

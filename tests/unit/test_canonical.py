"""Canonical JSON against RFC 8785 (JCS): the RFC's examples, its Appendix B number table,
UTF-16 member order, string escaping, what has no canonical form, and the key algorithm."""

from __future__ import annotations

import enum
import hashlib
import json
import random
import struct
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from pydantic import BaseModel

from outbox import OutboxError, PayloadError, canonical_json, idempotency_key
from outbox.canonical import MAX_SAFE_INTEGER, ecmascript_number, sha256_hex


def _double(bits: int) -> float:
    return float(struct.unpack(">d", bits.to_bytes(8, "big"))[0])


# RFC 8785 Appendix B, every row: IEEE-754 bit pattern -> ECMAScript serialization.
APPENDIX_B = [
    (0x0000000000000000, "0"),  # zero
    (0x8000000000000000, "0"),  # minus zero
    (0x0000000000000001, "5e-324"),  # min pos number
    (0x8000000000000001, "-5e-324"),  # min neg number
    (0x7FEFFFFFFFFFFFFF, "1.7976931348623157e+308"),  # max pos number
    (0xFFEFFFFFFFFFFFFF, "-1.7976931348623157e+308"),  # max neg number
    (0x4340000000000000, "9007199254740992"),  # max pos int
    (0xC340000000000000, "-9007199254740992"),  # max neg int
    (0x4430000000000000, "295147905179352830000"),  # ~2**68
    (0x44B52D02C7E14AF5, "9.999999999999997e+22"),
    (0x44B52D02C7E14AF6, "1e+23"),
    (0x44B52D02C7E14AF7, "1.0000000000000001e+23"),
    (0x444B1AE4D6E2EF4E, "999999999999999700000"),
    (0x444B1AE4D6E2EF4F, "999999999999999900000"),
    (0x444B1AE4D6E2EF50, "1e+21"),
    (0x3EB0C6F7A0B5ED8C, "9.999999999999997e-7"),
    (0x3EB0C6F7A0B5ED8D, "0.000001"),
    (0x41B3DE4355555553, "333333333.3333332"),
    (0x41B3DE4355555554, "333333333.33333325"),
    (0x41B3DE4355555555, "333333333.3333333"),
    (0x41B3DE4355555556, "333333333.3333334"),
    (0x41B3DE4355555557, "333333333.33333343"),
    (0xBECBF647612F3696, "-0.0000033333333333333333"),
    (0x43143FF3C1CB0959, "1424953923781206.2"),  # round to even
]
APPENDIX_B_ERRORS = [0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000]  # NaN, Infinity


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B, ids=lambda v: f"{v}")
def test_appendix_b_numbers(bits: int, expected: str) -> None:
    assert ecmascript_number(_double(bits)) == expected
    assert canonical_json([_double(bits)]) == f"[{expected}]".encode()


@pytest.mark.parametrize("bits", APPENDIX_B_ERRORS)
def test_appendix_b_nan_and_infinity_are_errors(bits: int) -> None:
    with pytest.raises(PayloadError, match="NaN and infinity"):
        canonical_json({"x": _double(bits)})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1e-7, "1e-7"),
        (1e-6, "0.000001"),
        (1.5e-6, "0.0000015"),
        (1e21, "1e+21"),
        (1.5e21, "1.5e+21"),
        (1e20, "100000000000000000000"),
        (-0.0, "0"),
        (2.0**60, "1152921504606847000"),  # shortest digits, zero-padded: not ...846976
        (0.1, "0.1"),
        (-123.456, "-123.456"),
        (100.0, "100"),
        (4.5, "4.5"),
        (1e30, "1e+30"),
        (123e-20, "1.23e-18"),
    ],
)
def test_number_layout(value: float, expected: str) -> None:
    assert ecmascript_number(value) == expected


def test_shortest_digits_read_back_as_the_same_double() -> None:
    rng = random.Random(8785)
    for _ in range(20_000):
        value = _double(rng.getrandbits(64))
        if value == value and abs(value) != float("inf"):
            assert float(ecmascript_number(value)) == value


def test_rfc_section_3_2_2_sample() -> None:
    text = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    assert (
        canonical_json(json.loads(text))
        == (
            '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
            '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
        ).encode()
    )


def test_rfc_section_3_2_3_members_sorted_by_utf16_code_units() -> None:
    text = (
        '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return",'
        ' "\\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One",'
        ' "\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control",'
        ' "\\u00f6": "Latin Small Letter O With Diaeresis"}'
    )
    out = canonical_json(json.loads(text)).decode()
    assert list(json.loads(out).values()) == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]
    assert out == (
        '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
        '"ö":"Latin Small Letter O With Diaeresis","€":"Euro Sign",'
        '"\U0001f600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    )


def test_nested_members_sorted_and_no_whitespace() -> None:
    value = {"b": [{"z": 1, "a": [2, {"y": None, "x": True}]}], "a": {}, "": []}
    assert canonical_json(value) == b'{"":[],"a":{},"b":[{"a":[2,{"x":true,"y":null}],"z":1}]}'


def test_string_escaping_is_only_the_required_escapes() -> None:
    controls = "".join(chr(c) for c in range(0x20))
    expected = (
        "\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000b\\f\\r"
        "\\u000e\\u000f\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018"
        "\\u0019\\u001a\\u001b\\u001c\\u001d\\u001e\\u001f"
    )
    assert canonical_json(controls) == f'"{expected}"'.encode()
    literal = "/ \x7f é € \u2028 \u2029 \U0001f600 \ufeff <script>"
    assert canonical_json(literal) == f'"{literal}"'.encode()
    assert canonical_json('"\\') == b'"\\"\\\\"'


@pytest.mark.parametrize("bad", ["\ud800", "a\udc00b", {"\ud83d": 1}])
def test_lone_surrogates_are_errors(bad: object) -> None:
    with pytest.raises(PayloadError, match="lone surrogate"):
        canonical_json(bad)


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), -float("inf"), Decimal("NaN"), Decimal("-Infinity")],
)
def test_nan_and_infinity_are_typed_errors(bad: object) -> None:
    with pytest.raises(PayloadError) as info:
        canonical_json({"x": [bad]})
    assert isinstance(info.value, OutboxError)


def test_integers_are_limited_to_the_interoperable_range() -> None:
    assert canonical_json([MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, 0, -1]) == (
        b"[9007199254740991,-9007199254740991,0,-1]"
    )
    for big in (MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1, 2**60):
        with pytest.raises(PayloadError, match="send it as a string"):
            canonical_json({"id": big})
    # The same magnitude given as a double is a number like any other.
    assert canonical_json(2.0**53) == b"9007199254740992"


def test_int_and_float_of_equal_value_are_the_same_number() -> None:
    assert canonical_json({"a": 1, "b": 990}) == canonical_json({"b": 990.0, "a": 1.0})
    assert canonical_json(True) == b"true"  # bool is not the number 1
    assert canonical_json([True, 1]) == b"[true,1]"


def test_decimals_that_are_doubles_and_those_that_are_not() -> None:
    assert canonical_json([Decimal("2.50"), Decimal("1E+30"), Decimal("0.1"), Decimal("-0")]) == (
        b"[2.5,1e+30,0.1,0]"
    )
    for lossy in (Decimal("0.1000000000000000000001"), Decimal("12345678901234567890")):
        with pytest.raises(PayloadError, match="not exactly an IEEE double"):
            canonical_json(lossy)


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Refund(BaseModel):
    charge: str
    amount: int
    at: datetime


def test_other_python_types_have_a_documented_form() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    value = {
        "model": Refund(charge="ch_1", amount=500, at=at),
        "uuid": uuid.UUID(int=9),
        "day": date(2026, 1, 2),
        "colour": Colour.RED,
        "level": Level.HIGH,
        "tuple": (1, "a"),
        "set": {"b", "a", "c"},
        "numbers": frozenset({10, 9, -1}),
        7: "int name",
    }
    assert canonical_json(value) == (
        b'{"7":"int name","colour":"red","day":"2026-01-02","level":3,'
        b'"model":{"amount":500,"at":"2026-01-02T03:04:05Z","charge":"ch_1"},'
        b'"numbers":[-1,10,9],"set":["a","b","c"],"tuple":[1,"a"],'
        b'"uuid":"00000000-0000-0000-0000-000000000009"}'
    )


def test_names_colliding_after_conversion_are_errors() -> None:
    with pytest.raises(PayloadError, match="same string"):
        canonical_json({1: "a", "1": "b"})


def test_unserializable_and_runaway_values_are_typed_errors() -> None:
    with pytest.raises(PayloadError, match="not JSON-serializable"):
        canonical_json({"x": object()})
    nested: list[object] = []
    nested.append(nested)
    with pytest.raises(PayloadError, match="nested too deeply"):
        canonical_json(nested)


def test_sha256_hex_is_the_hash_of_the_canonical_bytes() -> None:
    assert sha256_hex({"b": 1, "a": 2}) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()


def test_idempotency_key_follows_the_documented_algorithm() -> None:
    """The steps of the module docstring, done by hand; the pinned UUID was also derived
    independently with Node.js (JSON.stringify of the sorted document + crypto SHA-256)."""
    payload = {"note": "€\n", "currency": "EUR", "amount": 1e-7}
    document = '[["refund","ch_1","2"],{"amount":1e-7,"currency":"EUR","note":"€\\n"}]'
    raw = bytearray(hashlib.sha256(document.encode()).digest()[:16])
    raw[6] = raw[6] & 0x0F | 0x80
    raw[8] = raw[8] & 0x3F | 0x80
    key = idempotency_key("refund", "ch_1", 2, payload=payload)
    assert key == uuid.UUID(bytes=bytes(raw))
    assert str(key) == "76554bf5-64c0-8279-8bc7-78df8ebbade1"
    assert (key.version, key.variant) == (8, uuid.RFC_4122)
    # Big integers are fine as parts: a part is text before it is JSON.
    assert idempotency_key("order", 2**64) == idempotency_key("order", str(2**64))


@pytest.mark.parametrize(
    ("parts", "payload", "key"),
    [
        (
            ("refund", "ch_1"),
            {"amount": 500, "currency": "EUR"},
            "8fe2dc01-f472-8e88-9c4e-9d0bf7f21033",
        ),
        (
            ("order", 42, "created"),
            {"total": 19.99, "qty": 3, "note": "é €"},
            "7a336e80-6cef-8efe-85f5-461df5b424f6",
        ),
        (("order", 42), {"total": 1000.0}, "96c0c05a-0eb7-84d7-8d04-fab8863e4639"),
        (("order", 42, "created"), None, "a6287d6b-bc34-87b7-8a9f-caeccff54738"),
        (
            ("t",),
            {"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "id": uuid.UUID(int=9)},
            "ae520e1a-8c48-8b7d-9791-81e925b1bd44",
        ),
        (("d",), {"amount": Decimal("2.50")}, "745d234d-42db-8402-a78f-c036dcbaa33e"),
    ],
)
def test_keys_of_ordinary_payloads_are_unchanged_by_jcs(
    parts: tuple[str | int, ...], payload: object, key: str
) -> None:
    """Pinned from the encoder before RFC 8785: strings, safe integers, plain decimals and
    dates encode as they did, so keys already stored keep matching."""
    assert str(idempotency_key(*parts, payload=payload)) == key

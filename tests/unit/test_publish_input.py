"""Every input ``publish`` refuses is refused before any I/O with a typed error naming the
field (``PayloadError.field``), never a raw TypeError, UnicodeEncodeError or struct.error;
and what it accepts can be encoded for both sources (the WAL codec round-trips it)."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

import pytest

from outbox import (
    InvalidIdentifier,
    InvalidText,
    InvalidTopic,
    Message,
    PayloadError,
    PayloadTooLarge,
    identifiers,
    wal_codec,
)
from outbox.envelope import MAX_DELAY_SECONDS, MAX_SOURCE_BYTES, Row, prepare
from outbox.settings import ConsoleSettings
from outbox.text import printable, storable, unstorable

GOOD: dict[str, Any] = {"topic": "orders", "event_type": "order.created", "payload": {"a": 1}}


def prep(max_bytes: int = 1_048_576, **fields: Any) -> Row:
    message = Message(**{**GOOD, **fields})
    return prepare(message, lanes=16, max_bytes=max_bytes, default_source="urn:test")


# (fields, expected error class, expected field)
REFUSED: list[tuple[dict[str, Any], type[PayloadError], str | None]] = [
    ({"topic": 42}, InvalidTopic, "topic"),
    ({"topic": None}, InvalidTopic, "topic"),
    ({"topic": b"orders"}, InvalidTopic, "topic"),
    ({"topic": "orders\n"}, InvalidTopic, "topic"),
    ({"topic": "\norders"}, InvalidTopic, "topic"),
    ({"topic": "or ders"}, InvalidTopic, "topic"),
    ({"topic": "orders\x00"}, InvalidTopic, "topic"),
    ({"topic": "ördérs"}, InvalidTopic, "topic"),
    ({"topic": ""}, InvalidTopic, "topic"),
    ({"topic": ".."}, InvalidTopic, "topic"),
    ({"topic": "x" * 250}, InvalidTopic, "topic"),
    ({"event_type": "a\x00b"}, InvalidText, "event_type"),
    ({"event_type": "a\ud800"}, InvalidText, "event_type"),
    ({"event_type": 7}, PayloadError, "event_type"),
    ({"event_type": None}, PayloadError, "event_type"),
    ({"event_type": ""}, PayloadError, "event_type"),
    ({"event_type": "x" * 256}, PayloadError, "event_type"),
    ({"source": "urn:\x00"}, InvalidText, "source"),
    ({"source": "urn:\udcff"}, InvalidText, "source"),
    ({"source": 5}, PayloadError, "source"),
    ({"source": "s" * 70_000}, PayloadError, "source"),
    ({"source": "é" * (MAX_SOURCE_BYTES // 2 + 1)}, PayloadError, "source"),
    ({"key": "k\ud800"}, InvalidText, "key"),
    ({"key": 12}, PayloadError, "key"),
    ({"key": bytearray(b"k")}, PayloadError, "key"),
    ({"headers": {"h": "v\x00"}}, InvalidText, "header 'h'"),
    ({"headers": {"h\x00": "v"}}, InvalidText, "headers"),
    ({"headers": {"h": "\udc80"}}, InvalidText, "header 'h'"),
    ({"headers": {"h": 1}}, PayloadError, "headers"),
    ({"headers": {1: "v"}}, PayloadError, "headers"),
    ({"headers": [("h", "v")]}, PayloadError, "headers"),
    ({"headers": None}, PayloadError, "headers"),
    ({"headers": {"ce_id": "x"}}, PayloadError, "headers"),
    ({"headers": {"CE_SOURCE": "x"}}, PayloadError, "headers"),
    ({"delay_seconds": math.nan}, PayloadError, "delay_seconds"),
    ({"delay_seconds": math.inf}, PayloadError, "delay_seconds"),
    ({"delay_seconds": -math.inf}, PayloadError, "delay_seconds"),
    ({"delay_seconds": 1e15}, PayloadError, "delay_seconds"),
    ({"delay_seconds": -1}, PayloadError, "delay_seconds"),
    ({"delay_seconds": "5"}, PayloadError, "delay_seconds"),
    ({"delay_seconds": None}, PayloadError, "delay_seconds"),
    ({"delay_seconds": True}, PayloadError, "delay_seconds"),
    ({"delay_seconds": Decimal("NaN")}, PayloadError, "delay_seconds"),
    ({"payload": None}, PayloadError, "payload"),
    ({"payload": "text"}, PayloadError, "payload"),
    ({"payload": {"a": "\ud800"}}, PayloadError, "payload"),
    ({"payload": {"a": object()}}, PayloadError, "payload"),
    ({"payload": {"a": b"\xff"}}, PayloadError, "payload"),
    ({"payload": {"a": math.nan}}, PayloadError, "payload"),
    ({"event_id": "not-a-uuid"}, PayloadError, "event_id"),
    ({"event_id": 12}, PayloadError, "event_id"),
    ({"event_id": "\x00"}, PayloadError, "event_id"),
    ({"sequence": -1, "key": "k"}, PayloadError, "sequence"),
    ({"sequence": 2**63, "key": "k"}, PayloadError, "sequence"),
    ({"sequence": 1.5, "key": "k"}, PayloadError, "sequence"),
    ({"sequence": 1}, PayloadError, "sequence"),
]


@pytest.mark.parametrize(
    ("fields", "error", "field"), REFUSED, ids=[repr(f)[:60] for f, *_ in REFUSED]
)
def test_each_bad_input_gets_a_typed_error_naming_its_field(
    fields: dict[str, Any], error: type[PayloadError], field: str | None
) -> None:
    with pytest.raises(PayloadError) as info:
        prep(**fields)
    assert type(info.value) is error, info.value
    if field is not None:
        assert info.value.field == field
    assert str(info.value)  # a message saying why


def test_a_topic_error_is_also_an_identifier_error() -> None:
    with pytest.raises(InvalidIdentifier, match="trailing newline"):
        prep(topic="orders\n")


def test_a_message_that_is_not_a_message_is_refused() -> None:
    with pytest.raises(PayloadError, match=r"outbox\.Message, not dict"):
        prepare(GOOD, lanes=16, max_bytes=1000, default_source="s")  # type: ignore[arg-type]


def test_nul_in_a_text_field_is_one_error_class_in_every_field() -> None:
    for fields in (
        {"event_type": "\x00"},
        {"source": "\x00"},
        {"headers": {"h": "\x00"}},
        {"headers": {"\x00": "v"}},
    ):
        with pytest.raises(InvalidText, match="NUL character"):
            prep(**fields)


def test_what_is_fine_as_bytes_is_accepted() -> None:
    """NUL and any byte are fine in a key given as bytes, a str key's NUL, and payloads."""
    row = prep(key=b"\x00\xff", payload=b"\x00\xff")
    assert row.key == b"\x00\xff" and row.payload == b"\x00\xff"
    assert prep(key="a\x00b").key == b"a\x00b"
    assert prep(payload={"a": "\x00"}).payload == b'{"a":"\\u0000"}'


def test_sizes_are_counted_in_utf8_bytes() -> None:
    emoji = "\N{GRINNING FACE}"  # 1 character, 4 bytes
    prep(max_bytes=1000, payload=b"", key=b"", headers={"h": emoji * 249})  # 1 + 996
    with pytest.raises(PayloadTooLarge) as info:
        prep(max_bytes=1000, payload=b"", key=b"", headers={"h": emoji * 250})
    assert info.value.size == 1001
    with pytest.raises(PayloadTooLarge):
        prep(max_bytes=1000, payload=b"", key=emoji * 251)
    # The case: 300,000 emoji in a header under a 1 MiB limit (1.2 MB of UTF-8).
    with pytest.raises(PayloadTooLarge):
        prep(headers={"h": emoji * 300_000})


def test_delay_bounds_and_number_types() -> None:
    assert prep(delay_seconds=MAX_DELAY_SECONDS).delay_seconds == MAX_DELAY_SECONDS
    assert prep(delay_seconds=Decimal("1.5")).delay_seconds == 1.5
    assert prep(delay_seconds=0).delay_seconds == 0.0


def test_largest_source_round_trips_through_the_wal_encoding() -> None:
    row = prep(source="s" * MAX_SOURCE_BYTES, key="k", headers={"h": "v"})
    [event] = wal_codec.decode(wal_codec.encode([row]))
    assert event.source == row.source and event.headers == row.headers


@pytest.mark.parametrize(
    "name", ["orders\n", "orders\r\n", " orders", "orders ", "a/b", "", ".", "..", "x" * 250]
)
def test_kafka_names_are_matched_whole(name: str) -> None:
    assert not identifiers.is_kafka_name(name)
    with pytest.raises(InvalidIdentifier):
        identifiers.kafka_name(name, "consumer name")


@pytest.mark.parametrize("value", ["outbox\n", "Outbox", "1x", "", "a-b", "x" * 64])
def test_sql_identifiers_are_matched_whole(value: str) -> None:
    with pytest.raises(InvalidIdentifier):
        identifiers.sql_identifier(value)


@pytest.mark.parametrize("value", ["outbox_\n", "A_", "x" * 33, "a b"])
def test_table_prefixes_are_matched_whole(value: str) -> None:
    with pytest.raises(InvalidIdentifier):
        identifiers.table_prefix(value)
    assert identifiers.table_prefix("") == ""


def test_non_strings_are_invalid_identifiers_not_type_errors() -> None:
    for check in (identifiers.sql_identifier, identifiers.table_prefix, identifiers.kafka_name):
        with pytest.raises(InvalidIdentifier):
            check(5)  # type: ignore[arg-type]


def test_settings_patterns_are_matched_whole() -> None:
    """pydantic's patterns run on Rust's regex, where ``$`` is the end of the text."""
    ConsoleSettings(token_name="operator")
    with pytest.raises(ValueError, match="pattern"):
        ConsoleSettings(token_name="operator\n")


def test_no_identifier_pattern_in_the_code_base_ends_with_a_bare_dollar() -> None:
    """``$`` matches before a final newline in Python's re: patterns are fullmatch'ed."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for package in ("outbox", "inbox", "relay", "cli"):
        for path in (root / package).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"re\.compile\(r?\"\^[^\"]*\$\"", line):
                    offenders.append(f"{path.relative_to(root)}:{n}")
    assert offenders == []


def test_text_helpers_escape_what_postgres_and_terminals_refuse() -> None:
    assert unstorable("ok é", "id") is None
    assert "NUL" in (unstorable("a\x00", "id") or "")
    assert "surrogate" in (unstorable("a\ud800", "id") or "")
    assert storable("a\x00b\ud800") == "a\\x00b\\ud800"
    assert storable("plain é") == "plain é"
    assert printable(b"a\x00\xff\x1b[2J\n") == "a\\x00\\xff\\x1b[2J\\n"
    assert printable("tab\tok") == "tab\tok"


@pytest.mark.parametrize("name", ["billing\n", "billing ", ""])
def test_a_consumer_name_or_topic_with_a_trailing_newline_is_refused(name: str) -> None:
    import inbox

    with pytest.raises(InvalidIdentifier):
        inbox.Consumer(name=name, topics=["orders"])
    with pytest.raises(InvalidIdentifier):
        inbox.Consumer(name="billing", topics=[name or "a b"])

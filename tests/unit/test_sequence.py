"""The ``sequence`` of an event: written by ``publish`` as the CloudEvents ``sequence``
extension, read back by the consumer's stale-event guard."""

from __future__ import annotations

import json

import pytest

from inbox.errors import InvalidSequence
from inbox.event import InboxEvent
from outbox import Message, PayloadError
from outbox.envelope import MAX_SEQUENCE, SEQUENCE_HEADER, prepare


def _headers(**kw: object) -> dict[str, str]:
    base: dict[str, object] = {"topic": "orders", "event_type": "e", "payload": {}, "key": "k"}
    row = prepare(Message(**{**base, **kw}), lanes=8, max_bytes=1_000, default_source="urn:t")  # type: ignore[arg-type]
    headers: dict[str, str] = json.loads(row.headers)
    return headers


def test_sequence_is_zero_padded_so_string_order_is_numeric_order() -> None:
    assert _headers(sequence=7)[SEQUENCE_HEADER] == "00000000000000000007"
    assert _headers(sequence=MAX_SEQUENCE)[SEQUENCE_HEADER] == str(MAX_SEQUENCE).zfill(20)
    assert _headers(sequence=9)[SEQUENCE_HEADER] < _headers(sequence=10)[SEQUENCE_HEADER]
    assert SEQUENCE_HEADER not in _headers()


@pytest.mark.parametrize("bad", [-1, MAX_SEQUENCE + 1, True, 1.5, "3"])
def test_a_sequence_out_of_range_or_not_an_integer_is_refused(bad: object) -> None:
    with pytest.raises(PayloadError, match="sequence must be an integer"):
        _headers(sequence=bad)


def test_a_sequence_needs_a_key_and_cannot_be_set_as_a_header() -> None:
    with pytest.raises(PayloadError, match="needs a key"):
        _headers(sequence=1, key=None)
    with pytest.raises(PayloadError, match="reserved"):
        _headers(headers={SEQUENCE_HEADER: "5"})


def _event(*headers: tuple[str, bytes]) -> InboxEvent:
    return InboxEvent("id", "e", "t", 0, 0, b"k", b"{}", tuple(headers))


def test_the_consumer_reads_padded_and_plain_integers() -> None:
    assert _event((SEQUENCE_HEADER, b"00000000000000000042")).sequence == 42
    assert _event((SEQUENCE_HEADER, b"42")).sequence == 42
    assert _event().sequence is None


@pytest.mark.parametrize("raw", [b"v2", b"-1", b"1.0", b"", str(MAX_SEQUENCE + 1).encode()])
def test_an_unreadable_sequence_is_a_permanent_error(raw: bytes) -> None:
    with pytest.raises(InvalidSequence) as caught:
        _ = _event((SEQUENCE_HEADER, raw)).sequence
    assert caught.value.retriable is False

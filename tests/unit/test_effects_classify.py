"""The effect ledger's three failure classes (pure; no I/O beyond building exceptions)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
from email.message import Message
from typing import Any

import pytest

from outbox.effects import Ambiguous, EffectClass, classify, effect_key, key_for
from outbox.effects.classify import classifier
from outbox.effects.ledger import error_record
from outbox.effects.records import jsonable as _jsonable
from outbox.resilience import HttpStatusError, Permanent, Retryable
from outbox.resilience.breaker import CircuitOpen

R, P, A = EffectClass.RETRYABLE, EffectClass.PERMANENT, EffectClass.AMBIGUOUS


def http_error(status: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://x/refunds", status, "status", Message(), None)


class ConnectError(Exception):
    """Named like httpx's: the connection was never made."""


class ReadTimeout(Exception):
    """Named like httpx's: sent, no answer in time."""


class WithResponse(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = type("R", (), {"status_code": status})()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # Never sent, or refused unprocessed: retryable.
        (ConnectionRefusedError(111, "refused"), R),
        (socket.gaierror(-2, "Name or service not known"), R),
        (urllib.error.URLError(ConnectionRefusedError(111, "refused")), R),
        (urllib.error.URLError(socket.gaierror(-3, "Temporary failure")), R),
        (ConnectError("connect failed"), R),
        (http_error(429), R),
        (http_error(503), R),
        (http_error(408), R),
        (HttpStatusError(425), R),
        (WithResponse(503), R),
        (Retryable("declared"), R),
        # The request is wrong: permanent.
        (http_error(400), P),
        (http_error(401), P),
        (http_error(403), P),
        (http_error(404), P),
        (http_error(409), P),
        (http_error(422), P),
        (WithResponse(422), P),
        (ValueError("amount must be positive"), P),
        (TypeError("missing argument"), P),
        (Permanent("declared"), P),
        (CircuitOpen("psp", 1.0), P),
        # May have been applied: ambiguous.
        (TimeoutError("timed out"), A),
        (urllib.error.URLError(TimeoutError("timed out")), A),
        (ConnectionResetError(104, "reset by peer"), A),
        (http.client.RemoteDisconnected("closed without response"), A),
        (BrokenPipeError(32, "broken pipe"), A),
        (http.client.IncompleteRead(b"partial"), A),
        (ReadTimeout("read timed out"), A),
        (http_error(500), A),
        (http_error(502), A),
        (http_error(504), A),
        (WithResponse(502), A),
        (json.JSONDecodeError("bad", "doc", 0), A),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), A),
        (Ambiguous("declared"), A),
        (RuntimeError("something we do not know"), A),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_default_classification(exc: BaseException, expected: EffectClass) -> None:
    assert classify(exc) is expected


def test_a_custom_classifier_decides_first_and_none_falls_back() -> None:
    def partner(exc: BaseException) -> EffectClass | None:
        # This partner answers 409 when a request with the key is still being processed.
        return R if getattr(exc, "code", None) == 409 else None

    combined = classifier(partner)
    assert combined(http_error(409)) is R
    assert combined(http_error(422)) is P
    assert combined(TimeoutError()) is A
    assert classifier(None) is classify


def test_effect_key_is_stable_per_event_and_step() -> None:
    class Event:
        event_id = "evt-1"

    assert (
        effect_key("evt-1", "refund") == effect_key("evt-1", "refund") == key_for(Event(), "refund")
    )
    assert effect_key("evt-1", "refund") != effect_key("evt-1", "email")
    assert effect_key("evt-1", "refund") != effect_key("evt-2", "refund")
    assert len(effect_key("evt-1", "refund")) == 36  # a UUID's text


def test_results_are_stored_as_their_json_form() -> None:
    assert _jsonable("k", {"ids": (1, 2), "ok": True}) == ({"ids": [1, 2], "ok": True}, None)
    value, invalid = _jsonable("k", {"at": object()})
    assert value is None and invalid is not None and "not JSON-serializable" in str(invalid)
    assert _jsonable("k", float("nan"))[1] is not None


def test_a_stored_failure_keeps_type_status_and_one_bounded_line() -> None:
    record: dict[str, Any] = error_record(http_error(422))
    assert record == {"type": "HTTPError", "message": "HTTP Error 422: status", "status": 422}
    long = error_record(ValueError("x" * 2000 + "\nsecond line"))
    assert len(long["message"]) == 500 and long["status"] is None

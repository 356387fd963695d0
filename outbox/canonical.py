"""Canonical JSON and intent-derived keys.

Two encodings of the same value must hash the same, so canonical JSON sorts keys, uses no
insignificant whitespace, and writes a number with an integral value as an integer
(``1.0`` and ``1`` are the same amount). Non-JSON types (datetime, UUID, Decimal, pydantic
models) go through pydantic's JSON conversion first.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from decimal import Decimal
from typing import Any

from pydantic_core import to_jsonable_python

from outbox.errors import PayloadError


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float | Decimal):
        if isinstance(value, float) and not math.isfinite(value):
            raise PayloadError("NaN and infinity have no JSON representation")
        if value == value.to_integral_value() if isinstance(value, Decimal) else value.is_integer():
            return int(value)
        return float(value)
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    try:
        return _normalize(to_jsonable_python(value))
    except Exception as exc:  # pydantic raises its own type for unserializable values
        raise PayloadError(
            f"value of type {type(value).__name__} is not JSON-serializable"
        ) from exc


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes for ``value`` (sorted keys, compact, normalized numbers)."""
    return json.dumps(
        _normalize(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def sha256_hex(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``, hex encoded."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def idempotency_key(*parts: str | int | uuid.UUID, payload: Any = None) -> uuid.UUID:
    """A stable event id derived from the *intent* of an operation.

    The same parts (e.g. ``"order", order_id, "created"``) and payload always give the same
    UUID, so a retried request publishes the same ``event_id`` and the outbox (and every
    consumer's inbox) sees a duplicate instead of a second event. Never include timestamps,
    attempt counters or random values in ``parts``: they defeat the purpose.

    >>> idempotency_key("order", 42, "created") == idempotency_key("order", 42, "created")
    True
    """
    if not parts:
        raise PayloadError("idempotency_key needs at least one part naming the intent")
    for part in parts:
        if not isinstance(part, str | int | uuid.UUID) or isinstance(part, bool):
            raise PayloadError(
                f"idempotency_key parts must be str, int or UUID, not {type(part).__name__}"
            )
    digest = hashlib.sha256(canonical_json([[str(p) for p in parts], payload])).digest()
    # RFC 9562 version 8 ("custom") UUID built from the first 128 bits of the digest.
    raw = bytearray(digest[:16])
    raw[6] = (raw[6] & 0x0F) | 0x80
    raw[8] = (raw[8] & 0x3F) | 0x80
    return uuid.UUID(bytes=bytes(raw))

"""Canonical JSON (RFC 8785, the JSON Canonicalization Scheme) and intent-derived keys.

Equal values must hash equally here *and* in a Go, Java or JavaScript service, so
:func:`canonical_json` writes exactly the bytes RFC 8785 defines:

- no whitespace; object members sorted by their names as arrays of UTF-16 code units
  (so U+1F600, the pair D83D DE00, sorts *before* U+FB33); duplicate names are an error;
- strings escaped as ECMAScript's ``JSON.stringify`` does: ``\\b \\t \\n \\f \\r \\" \\\\``
  and ``\\u00xx`` (lowercase hex) for the other controls below U+0020; everything else,
  U+007F, U+2028 and all non-ASCII included, is literal UTF-8. A lone surrogate is an error;
- numbers are IEEE-754 doubles written as ECMAScript's ``Number.prototype.toString``
  (``1e-7``, ``0.000001``, ``1e+21``, ``100000000000000000000``, ``-0`` -> ``0``); so
  ``1.0`` and ``1`` are the same number and encode as ``1``. NaN and infinities are errors.

Python values map onto that model as follows. ``int`` must lie in the I-JSON range
±(2**53 - 1) — outside it a double cannot hold the value exactly, other languages would
have rounded it before canonicalizing, and two different integers would give one key — so a
larger one raises :class:`~outbox.errors.PayloadError`: send it as a string. ``float`` is
a double already. ``Decimal`` is accepted when a double holds it without loss (``2.50`` ->
``2.5``, ``1E+30`` -> ``1e+30``), else it is an error for the same reason. ``tuple`` is an
array; ``set``/``frozenset`` is an array of its members in the order of their canonical
bytes. A non-string member name is converted with ``str()`` (portable only for ``int``).
Every other type (pydantic models, dataclasses, ``datetime``/``date``/``time`` as ISO 8601
strings, ``UUID`` as its lowercase hyphenated form, ``Enum`` as its value, ``bytes`` as
UTF-8 text) goes through pydantic's JSON mode (``to_jsonable_python``) first.

``idempotency_key`` (the algorithm, so another service can derive the same key):

1. each part becomes text: a ``str`` as is, an ``int`` in decimal (any size, ``-`` for
   negatives), a ``UUID`` as 36 lowercase characters with hyphens;
2. the document ``[[part, part, ...], payload]`` (``payload`` is ``null`` when omitted)
   is encoded with RFC 8785 as above, UTF-8;
3. SHA-256 of those bytes; the first 16 bytes of the digest become an RFC 9562 version 8
   UUID: ``byte[6] = byte[6] & 0x0F | 0x80`` and ``byte[8] = byte[8] & 0x3F | 0x80``;
4. the key is that UUID in its usual text form (lowercase, hyphenated).

``sha256_hex(value)`` is the lowercase hex SHA-256 of ``canonical_json(value)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from outbox.errors import PayloadError

# I-JSON (RFC 7493) interoperable integers: every double-based parser reads them exactly.
MAX_SAFE_INTEGER = 2**53 - 1
NON_FINITE = "NaN and infinity have no JSON representation"


class _NonFinite(PayloadError):
    """Raised where the number is met; :func:`canonical_json` replaces it by an error that
    says where in the value it is (found again by :func:`check_finite`)."""


def check_finite(value: Any, what: str = "value") -> None:
    """Refuse NaN and ±Infinity anywhere in ``value``: the one rule for every JSON the
    library writes (payloads on the wire, canonical JSON for keys and hashes).

    RFC 8259 has no such numbers; Python's encoders write ``NaN``/``Infinity``, which
    JavaScript's ``JSON.parse``, Jackson and Go reject, and pydantic models write ``null``
    by default, which silently changes the value. Raises :class:`PayloadError` naming the
    place as a JSON path (``payload $.items[3].price is NaN``). Walks mappings, lists,
    tuples, sets, dataclasses and pydantic models; a model whose ``model_config`` sets
    ``ser_json_inf_nan`` to ``"null"`` or ``"strings"`` chose how it writes them and is
    not looked into. ``Decimal("NaN")`` counts too.
    """
    found = _non_finite(value)
    if found is not None:
        spelled, path = found
        raise PayloadError(
            f"{what} {_json_path(path)} is {spelled}: {NON_FINITE} (RFC 8259); "
            "send null or a string",
            what,
        )


def _non_finite(value: Any) -> tuple[str, list[str | int]] | None:
    """The first NaN or infinity, spelled as JavaScript does, and its path (innermost part
    first); None when there is none."""
    if isinstance(value, str | int | bytes | None):
        return None
    if isinstance(value, float | Decimal):
        if value.is_finite() if isinstance(value, Decimal) else math.isfinite(value):
            return None
        return ("NaN" if value != value else "Infinity" if value > 0 else "-Infinity"), []
    items: Iterable[tuple[str | int, Any]]
    if isinstance(value, Mapping):
        items = ((str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        items = enumerate(value)
    elif isinstance(value, BaseModel):
        if value.model_config.get("ser_json_inf_nan") in ("null", "strings"):
            return None
        items = [*vars(value).items(), *(value.__pydantic_extra__ or {}).items()]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    else:
        return None
    for part, child in items:
        found = _non_finite(child)
        if found is not None:
            found[1].append(part)
            return found
    return None


def _json_path(path: list[str | int]) -> str:
    text = "$"
    for part in reversed(path):
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isidentifier():
            text += f".{part}"
        else:
            text += f"[{encode_basestring(part)}]"
    return text


def ecmascript_number(value: float) -> str:
    """``Number.prototype.toString`` of a finite double (RFC 8785 §3.2.2.3).

    Python's ``repr`` already picks the digits ECMAScript asks for (the shortest string
    that reads back as the same double, the closest one on a tie); only the layout
    differs, so this re-lays them out: ``s`` the significant digits, ``n`` the position
    of the decimal point relative to their start (value = 0.s * 10**n).
    """
    if not math.isfinite(value):
        raise _NonFinite(NON_FINITE)
    if value == 0:
        return "0"  # minus zero too
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    significant = (whole + fraction).lstrip("0")
    n = len(whole) + int(exponent or 0) - (len(whole) + len(fraction) - len(significant))
    digits = significant.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = f"{digits[:n]}.{digits[n:]}"
    elif -6 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        point = f"{digits[0]}.{digits[1:]}" if k > 1 else digits
        text = f"{point}e{n - 1:+d}"
    return "-" + text if value < 0 else text


def _int(value: int) -> str:
    if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        return int.__repr__(value)  # not str(): an IntEnum member must write its number
    raise PayloadError(
        f"integer {value} is outside ±(2**53 - 1): JSON numbers are IEEE doubles and "
        "cannot hold it exactly; send it as a string"
    )


def _decimal(value: Decimal) -> str:
    if not value.is_finite():
        raise _NonFinite(NON_FINITE)
    double = float(value)
    if not math.isfinite(double) or Decimal(repr(double)) != value:
        raise PayloadError(
            f"Decimal {value} is not exactly an IEEE double (JSON numbers are doubles); "
            "send it as a string"
        )
    return ecmascript_number(double)


def _utf16(name: str) -> bytes:
    # Big-endian UTF-16 bytes compare exactly as the code units do.
    return name.encode("utf-16-be", "surrogatepass")


def _members(value: Mapping[Any, Any]) -> Mapping[str, Any]:
    if all(isinstance(name, str) for name in value):
        return value
    members = {name if isinstance(name, str) else str(name): v for name, v in value.items()}
    if len(members) != len(value):
        raise PayloadError("two member names of an object convert to the same string")
    return members


def _object(value: Mapping[Any, Any]) -> str:
    members = _members(value)
    # Code point order is UTF-16 order unless a name holds a character beyond U+FFFF;
    # all-ASCII names (the usual case) skip the re-encoding.
    ascii_names = all(name.isascii() for name in members)
    names = sorted(members) if ascii_names else sorted(members, key=_utf16)
    return "{" + ",".join(f"{encode_basestring(n)}:{_encode(members[n])}" for n in names) + "}"


def _array(value: list[Any] | tuple[Any, ...]) -> str:
    return "[" + ",".join(map(_encode, value)) + "]"


def _set(value: set[Any] | frozenset[Any]) -> str:
    # A set has no order of its own: its members go in the order of their encodings.
    return "[" + ",".join(sorted(map(_encode, value))) + "]"


def _literal(value: bool | None) -> str:
    return "null" if value is None else "true" if value else "false"


# Exact types first (one lookup); subclasses and everything else through the slow path.
_ENCODERS: dict[type, Callable[[Any], str]] = {
    str: encode_basestring,
    int: _int,
    float: ecmascript_number,
    bool: _literal,
    type(None): _literal,
    dict: _object,
    list: _array,
    tuple: _array,
}


def _encode(value: Any) -> str:
    encoder = _ENCODERS.get(type(value))
    if encoder is not None:
        return encoder(value)
    if isinstance(value, str):
        return encode_basestring(value)
    if isinstance(value, int):  # IntEnum, IntFlag (bool cannot be subclassed)
        return _int(value)
    if isinstance(value, float):
        return ecmascript_number(value)
    if isinstance(value, Decimal):
        return _decimal(value)
    if isinstance(value, Mapping):
        return _object(value)
    if isinstance(value, list | tuple):
        return _array(value)
    if isinstance(value, set | frozenset):
        return _set(value)
    try:
        plain = to_jsonable_python(value)
    except Exception as exc:  # pydantic raises its own type for unserializable values
        raise PayloadError(
            f"value of type {type(value).__name__} is not JSON-serializable"
        ) from exc
    return _encode(plain)


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical JSON bytes (UTF-8) of ``value``; see the module docstring.

    Raises :class:`~outbox.errors.PayloadError` for what has no canonical form: NaN,
    infinities, integers beyond ±(2**53 - 1), lone surrogates, unserializable types.
    """
    return _canonical(value, value, "value")


def _canonical(value: Any, located: Any, what: str) -> bytes:
    """``canonical_json(value)``; a NaN or infinity is reported by its place in ``located``
    (``value`` itself, or the part of it the caller gave)."""
    try:
        return _encode(value).encode()
    except _NonFinite:
        check_finite(located, what)
        raise  # a type encoded through pydantic that the walk does not look into
    except UnicodeEncodeError:
        raise PayloadError("a string contains a lone surrogate (not valid Unicode)") from None
    except RecursionError:
        raise PayloadError("value is nested too deeply (or contains itself)") from None


def sha256_hex(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``, hex encoded."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def idempotency_key(*parts: str | int | uuid.UUID, payload: Any = None) -> uuid.UUID:
    """A stable event id derived from the *intent* of an operation.

    The same parts (e.g. ``"order", order_id, "created"``) and payload always give the same
    UUID, so a retried request publishes the same ``event_id`` and the outbox (and every
    consumer's inbox) sees a duplicate instead of a second event. Never include timestamps,
    attempt counters or random values in ``parts``: they defeat the purpose. The exact
    algorithm (for other languages) is in this module's docstring.

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
    document = [[str(p) for p in parts], payload]
    digest = hashlib.sha256(_canonical(document, payload, "payload")).digest()
    raw = bytearray(digest[:16])
    raw[6] = (raw[6] & 0x0F) | 0x80
    raw[8] = (raw[8] & 0x3F) | 0x80
    return uuid.UUID(bytes=bytes(raw))

"""Text from outside (a record's ids and headers, an exception's message) made fit for
where it goes: a PostgreSQL ``text`` column, which refuses NUL characters and lone
surrogates, or an operator's terminal, where control characters would act.

Both escape with backslashes (``\\x00``, ``\\udc80``): readable, not reversible (the
original may hold a backslash too). The exact original stays in bytes elsewhere: a dead
letter's key, value and header values, and the record on its dead-letter topic.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def unstorable(text: str, what: str) -> str | None:
    """Why PostgreSQL cannot store ``text`` (named ``what`` in the reason), or None."""
    if "\x00" in text:
        return f"{what} holds a NUL character (U+0000), which PostgreSQL text cannot store"
    if not text.isascii():  # O(1) in CPython: ASCII text costs nothing more
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            return f"{what} holds a lone surrogate at index {exc.start} (not UTF-8)"
    return None


def storable(text: str) -> str:
    """``text`` with what a ``text`` column refuses escaped: NUL, lone surrogates."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def printable(value: bytes | str) -> str:
    """``value`` for a terminal line: bytes decoded as UTF-8 (others as ``\\xff``), lone
    surrogates and control characters (NUL, ESC, newlines...) escaped; tabs kept."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    value = storable(value)
    if value.isprintable():
        return value
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", value).replace("\n", "\\n")

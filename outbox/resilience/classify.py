"""Error classification shared by retries, the breaker, the inbox and the effect ledger.

:func:`is_retryable` decides whether an exception is worth another attempt: the exception's
own ``retriable`` flag, then its HTTP status, then its type. :class:`Permanent` and
:class:`Retryable` let user code declare the answer. ``Retry-After`` hints are read here too,
so every retrying caller honours the server's wish the same way.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from datetime import UTC
from typing import Any

from outbox.errors import OutboxError

# Statuses a retry can fix: timeouts, "too early", throttling, and server-side failures.
# Every other 4xx says the request itself is wrong; sending it again changes nothing.
_RETRYABLE_4XX = frozenset({408, 425, 429})
_DELAY_SECONDS = re.compile(r"\s*(\d+(?:\.\d+)?)\s*")


class _Declared(OutboxError):
    """A failure user code declares, optionally naming the one event it belongs to."""

    def __init__(self, *args: object, event: object | None = None) -> None:
        super().__init__(*args)
        # In a batch handler: the item of the list (the model, the InboxEvent or its
        # EventContext) that failed, so that only it is retried or dead-lettered.
        self.event = event


class Permanent(_Declared):
    """Raise (or subclass) to declare a failure that retrying cannot fix.

    A batch handler names the event at fault with ``event=``: that event alone is
    dead-lettered and the rest of the list is handled again without it::

        raise Permanent("negative total", event=order)
    """

    retriable = False


class Retryable(_Declared):
    """Raise (or subclass) to declare a transient failure worth retrying (``event=``: in a
    batch handler, only that event is retried; the ones before it commit)."""

    retriable = True


def is_retryable_status(status: int) -> bool:
    """HTTP classification: 408, 425, 429 and every 5xx are retryable; nothing else is."""
    return status in _RETRYABLE_4XX or 500 <= status <= 599


class HttpStatusError(OutboxError):
    """A failed HTTP exchange, classified by its status (raise it from a client wrapper).

    >>> HttpStatusError(503).retriable, HttpStatusError(404).retriable
    (True, False)
    """

    def __init__(self, status_code: int, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.retry_after = retry_after
        self.retriable = is_retryable_status(status_code)

    @classmethod
    def from_response(
        cls, status_code: int, headers: Mapping[str, str], now: float | None = None
    ) -> HttpStatusError:
        """Build from a response's status and headers, reading ``Retry-After``."""
        return cls(status_code, retry_after_seconds(_header(headers, "retry-after"), now))


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (on itself or its ``response``), if any."""
    # Duck-typed so that httpx/requests/aiohttp/starlette errors classify without imports.
    for holder in (exc, getattr(exc, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
                return value
    return None


def is_retryable(exc: BaseException) -> bool:
    """Classify an exception: retry it (True) or surface it (False).

    In order: the exception's own boolean ``retriable`` flag (every framework error and
    aiokafka's errors carry one; :class:`Permanent` / :class:`Retryable` let user code
    declare it); else an HTTP status on it or its ``response`` (408/425/429/5xx retryable,
    other codes not); else programming/validation errors (``ValueError``, ``TypeError``,
    ``LookupError``) are permanent; everything else — connection resets, timeouts, DNS
    failures — is retryable, because the attempt limit bounds it anyway while wrongly
    calling a transient fault permanent would dead-letter good work.
    """
    flag = getattr(exc, "retriable", None)
    if isinstance(flag, bool):
        return flag
    status = status_of(exc)
    if status is not None:
        return is_retryable_status(status)
    return not isinstance(exc, ValueError | TypeError | LookupError)


def _header(headers: Any, name: str) -> str | None:
    if headers is None:
        return None
    value = headers.get(name) if hasattr(headers, "get") else None
    if value is None and isinstance(headers, Mapping):
        # Plain dicts are case-sensitive; HTTP header names are not.
        value = next((v for k, v in headers.items() if str(k).lower() == name), None)
    return None if value is None else str(value)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Parse a ``Retry-After`` value: delay-seconds or an HTTP-date (RFC 9110 §10.2.3).

    Returns seconds to wait (never negative), or None when absent or unparseable — a
    malformed hint is ignored rather than trusted.
    """
    if value is None:
        return None
    match = _DELAY_SECONDS.fullmatch(value)
    if match:
        return float(match.group(1))
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def retry_after_of(exc: BaseException, now: float | None = None) -> float | None:
    """The server's ``Retry-After`` carried by an exception, if any.

    Looks at a ``retry_after`` attribute (seconds or header text), then at a ``Retry-After``
    header on ``exc.headers`` or ``exc.response.headers``.
    """
    hint = getattr(exc, "retry_after", None)
    if isinstance(hint, int | float) and not isinstance(hint, bool):
        return max(0.0, float(hint))
    if isinstance(hint, str):
        return retry_after_seconds(hint, now)
    for holder in (exc, getattr(exc, "response", None)):
        value = _header(getattr(holder, "headers", None), "retry-after")
        if value is not None:
            return retry_after_seconds(value, now)
    return None

"""Retry toolkit shared by the relay, the inbox and users' own outbound calls.

Backoff is exponential with *full jitter*: ``sleep = uniform(0, min(cap, base * 2**attempt))``.
Jitter over the whole interval spreads retries of many replicas apart, so a recovering
dependency is not hit by synchronized waves (the retry-storm trap).

Pieces, usable alone or together through :class:`Retrier`:

* classification — :func:`is_retryable` (an exception's own ``retriable`` flag, then its
  HTTP status, then its type) and :func:`is_retryable_status` (408/425/429/5xx);
* :class:`RetryPolicy` — attempts, backoff, a total-delay limit, ``Retry-After``;
* :class:`outbox.budget.RetryBudget` — retries capped to a fraction of the requests;
* :class:`outbox.breaker.CircuitBreaker` — fail fast while a dependency is down.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.budget import RetryBudget, RetryBudgetExhausted
from outbox.errors import ConfigurationError, OutboxError
from outbox.settings import RetrySettings

if TYPE_CHECKING:
    from outbox.breaker import CircuitBreaker

T = TypeVar("T")

# Statuses a retry can fix: timeouts, "too early", throttling, and server-side failures.
# Every other 4xx says the request itself is wrong; sending it again changes nothing.
_RETRYABLE_4XX = frozenset({408, 425, 429})
_DELAY_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*$")


class Permanent(OutboxError):
    """Raise (or subclass) to declare a failure that retrying cannot fix."""

    retriable = False


class Retryable(OutboxError):
    """Raise (or subclass) to declare a transient failure worth retrying."""

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
    match = _DELAY_SECONDS.match(value)
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


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry. Pure: no sleeping, no clock but ``wall_clock``.

    ``max_total_delay_seconds`` bounds the whole operation: a retry whose wait would end
    past it is not made (the wait is shortened to fit, unless the server's ``Retry-After``
    demands more — then the caller gives up instead of ignoring the server).
    """

    base_seconds: float = 0.1
    cap_seconds: float = 30.0
    max_attempts: int = 5
    rng: Callable[[float, float], float] = field(default=random.uniform, compare=False)
    max_total_delay_seconds: float | None = None
    # Only used to turn an HTTP-date Retry-After into seconds.
    wall_clock: Callable[[], float] = field(default=time.time, compare=False)

    def __post_init__(self) -> None:
        if self.base_seconds <= 0 or self.cap_seconds <= 0 or self.max_attempts < 1:
            raise ConfigurationError("retry policy needs base > 0, cap > 0 and max_attempts >= 1")
        if self.max_total_delay_seconds is not None and self.max_total_delay_seconds <= 0:
            raise ConfigurationError("max_total_delay_seconds must be > 0 when set")

    @classmethod
    def from_settings(cls, settings: RetrySettings) -> RetryPolicy:
        return cls(
            settings.base_seconds,
            settings.cap_seconds,
            settings.max_attempts,
            max_total_delay_seconds=settings.max_total_delay_seconds,
        )

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (0-based): full jitter under the cap."""
        ceiling = min(self.cap_seconds, self.base_seconds * 2 ** min(attempt, 62))
        return self.rng(0.0, ceiling)

    def should_retry(self, attempts_made: int, exc: BaseException) -> bool:
        """True when ``exc`` is retryable and fewer than ``max_attempts`` were made."""
        return attempts_made < self.max_attempts and is_retryable(exc)

    def next_delay(
        self, attempts_made: int, exc: BaseException, elapsed: float = 0.0
    ) -> float | None:
        """Seconds to wait before the next attempt, or None to give up and surface ``exc``.

        ``attempts_made`` counts attempts so far (>= 1); ``elapsed`` is the time since the
        first one started. The wait is the jittered backoff, raised to the server's
        ``Retry-After`` when there is one.
        """
        if not self.should_retry(attempts_made, exc):
            return None
        delay = self.backoff(attempts_made - 1)
        hint = retry_after_of(exc, self.wall_clock())
        if hint is not None:
            delay = max(delay, hint)
        if self.max_total_delay_seconds is None:
            return delay
        remaining = self.max_total_delay_seconds - elapsed
        if remaining <= 0 or (hint is not None and hint > remaining):
            return None
        return min(delay, remaining)


RetryListener = Callable[[int, BaseException, float], None]


@dataclass
class Retrier:
    """Runs a call under a policy, an optional process budget and an optional breaker.

    >>> retrier = Retrier(RetryPolicy(), budget=RetryBudget(), breaker=CircuitBreaker("psp"))
    >>> retrier.call(lambda: psp.refund(charge_id, amount, idempotency_key=key))  # doctest: +SKIP

    Pass the *same* idempotency key to every attempt: retries are only safe when the
    dependency can recognise them as one operation. An open circuit
    (:class:`outbox.breaker.CircuitOpen`) and an exhausted budget
    (:class:`RetryBudgetExhausted`) fail at once and are never retried.
    """

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    budget: RetryBudget | None = None
    breaker: CircuitBreaker | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    on_retry: RetryListener | None = None  # (attempts_made, error, delay): logs, metrics

    def _delay_or_none(self, attempts_made: int, exc: Exception, started: float) -> float | None:
        delay = self.policy.next_delay(attempts_made, exc, self.clock() - started)
        if delay is None:
            return None
        if self.budget is not None and not self.budget.try_spend():
            raise RetryBudgetExhausted(attempts_made) from exc
        if self.on_retry is not None:
            self.on_retry(attempts_made, exc, delay)
        return delay

    def call(self, fn: Callable[[], T]) -> T:
        """Call ``fn()`` until it succeeds or the policy, budget or breaker says stop."""
        started = self.clock()
        if self.budget is not None:
            self.budget.record_request()
        attempts = 0
        while True:
            attempts += 1
            try:
                if self.breaker is None:
                    return fn()
                with self.breaker.guard():
                    return fn()
            except Exception as exc:
                delay = self._delay_or_none(attempts, exc, started)
                if delay is None:
                    raise
            self.sleep(delay)

    async def call_async(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Async :meth:`call`: ``await fn()`` with the same rules."""
        started = self.clock()
        if self.budget is not None:
            self.budget.record_request()
        attempts = 0
        while True:
            attempts += 1
            try:
                if self.breaker is None:
                    return await fn()
                with self.breaker.guard():
                    return await fn()
            except Exception as exc:
                delay = self._delay_or_none(attempts, exc, started)
                if delay is None:
                    raise
            await self.async_sleep(delay)

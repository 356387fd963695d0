"""Retry toolkit shared by the relay, the inbox and users' own outbound calls.

Backoff is exponential with *full jitter*: ``sleep = uniform(0, min(cap, base * 2**attempt))``.
Jitter over the whole interval spreads retries of many replicas apart, so a recovering
dependency is not hit by synchronized waves (the retry-storm trap).

Pieces, usable alone or together through :class:`Retrier`:

* classification — :mod:`outbox.resilience.classify`;
* :class:`RetryPolicy` — attempts, backoff, a total-delay limit, ``Retry-After``;
* :class:`outbox.resilience.budget.RetryBudget` — retries capped to a fraction of the requests;
* :class:`outbox.resilience.breaker.CircuitBreaker` — fail fast while a dependency is down.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from outbox.errors import ConfigurationError
from outbox.resilience.breaker import CircuitBreaker
from outbox.resilience.budget import RetryBudget, RetryBudgetExhausted
from outbox.resilience.classify import is_retryable, retry_after_of
from outbox.settings import RetrySettings

T = TypeVar("T")


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
        if not is_retryable(exc):
            return None
        return self.delay_for(attempts_made, exc, elapsed)

    def delay_for(
        self,
        attempts_made: int,
        exc: BaseException,
        elapsed: float = 0.0,
        *,
        limit: float | None = None,
    ) -> float | None:
        """:meth:`next_delay` for a failure the caller already judged worth another try.
        ``limit`` caps the wait; a ``Retry-After`` beyond it gives up instead."""
        if attempts_made >= self.max_attempts:
            return None
        delay = self.backoff(attempts_made - 1)
        hint = retry_after_of(exc, self.wall_clock())
        if hint is not None:
            if limit is not None and hint > limit:
                return None
            delay = max(delay, hint)
        if limit is not None:
            delay = min(delay, limit)
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
    (:class:`outbox.resilience.breaker.CircuitOpen`) and an exhausted budget
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

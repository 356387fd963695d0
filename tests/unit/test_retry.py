"""Retry policy, classification and the Retrier — fake clock and rng, no sleeping."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from outbox.errors import BrokerUnavailable, ConfigurationError, PayloadError
from outbox.resilience import (
    HttpStatusError,
    Permanent,
    Retrier,
    Retryable,
    RetryPolicy,
    is_retryable,
    is_retryable_status,
    retry_after_of,
    retry_after_seconds,
)
from outbox.resilience.breaker import CircuitBreaker, CircuitOpen
from outbox.resilience.budget import RetryBudget, RetryBudgetExhausted
from outbox.settings import RetrySettings

NOW = 1_800_000_000.0


@dataclass
class FakeTime:
    """A clock whose sleep only advances the clock, recording each delay."""

    now: float = 0.0
    slept: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


def upper(lo: float, hi: float) -> float:
    return hi


# ------------------------------------------------------------------ backoff bounds


def test_full_jitter_delays_stay_within_bounds_and_spread_over_many_draws() -> None:
    policy = RetryPolicy(base_seconds=0.1, cap_seconds=2.0, rng=random.Random(7).uniform)
    for attempt in range(8):
        ceiling = min(2.0, 0.1 * 2**attempt)
        draws = [policy.backoff(attempt) for _ in range(2000)]
        assert all(0.0 <= d <= ceiling for d in draws)
        # Full jitter covers the whole interval, not just its top (no synchronized waves).
        assert min(draws) < 0.05 * ceiling and max(draws) > 0.95 * ceiling
        assert abs(sum(draws) / len(draws) - ceiling / 2) < 0.05 * ceiling


def test_backoff_is_capped_even_for_huge_attempt_numbers() -> None:
    policy = RetryPolicy(base_seconds=0.5, cap_seconds=10.0, rng=upper)
    assert [policy.backoff(a) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert policy.backoff(10_000) == 10.0


def test_existing_api_keeps_working() -> None:
    policy = RetryPolicy(0.1, 30.0, 3)
    assert policy.should_retry(1, Retryable("x")) and policy.should_retry(2, BrokerUnavailable())
    assert not policy.should_retry(3, Retryable("x"))
    assert not policy.should_retry(1, Permanent("x"))
    from_settings = RetryPolicy.from_settings(RetrySettings(base_seconds=0.2, max_attempts=7))
    assert (from_settings.base_seconds, from_settings.max_attempts) == (0.2, 7)


def test_invalid_policy_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(base_seconds=0)
    with pytest.raises(ConfigurationError):
        RetryPolicy(max_total_delay_seconds=-1)


# ------------------------------------------------------------------ classification


@pytest.mark.parametrize(
    ("status", "retry"),
    [
        (408, True),
        (425, True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (400, False),
        (401, False),
        (403, False),
        (404, False),
        (409, False),
        (422, False),
    ],
)
def test_http_status_classification(status: int, retry: bool) -> None:
    assert is_retryable_status(status) is retry
    assert is_retryable(HttpStatusError(status)) is retry


class _Response:
    def __init__(self, status_code: int, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.headers = headers


class ClientError(Exception):
    """Shaped like httpx.HTTPStatusError: the status lives on ``.response``."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.response = _Response(status, headers or {})


def test_exceptions_classify_by_flag_then_status_then_type() -> None:
    assert is_retryable(ConnectionResetError()) and is_retryable(TimeoutError())
    assert is_retryable(OSError("dns lookup failed"))
    assert not is_retryable(ValueError("bad input")) and not is_retryable(KeyError("k"))
    assert is_retryable(ClientError(503)) and not is_retryable(ClientError(400))
    assert not is_retryable(PayloadError("too big"))  # framework errors carry their flag
    assert not is_retryable(CircuitOpen("psp", 3.0))
    assert not is_retryable(RetryBudgetExhausted(2))

    class Declared(Exception):
        retriable = False
        status_code = 503  # the flag wins over the status

    assert not is_retryable(Declared())


# ------------------------------------------------------------------ Retry-After


def test_retry_after_parses_seconds_and_http_dates() -> None:
    assert retry_after_seconds("120") == 120.0
    assert retry_after_seconds(" 3 ") == 3.0
    later = format_datetime(datetime.fromtimestamp(NOW + 30, UTC), usegmt=True)
    assert retry_after_seconds(later, now=NOW) == pytest.approx(30.0)
    earlier = format_datetime(datetime.fromtimestamp(NOW - 30, UTC), usegmt=True)
    assert retry_after_seconds(earlier, now=NOW) == 0.0
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None
    assert retry_after_seconds("-5") is None


def test_retry_after_is_found_on_the_exception_or_its_response() -> None:
    assert retry_after_of(HttpStatusError(429, retry_after=7)) == 7.0
    assert retry_after_of(ClientError(503, {"Retry-After": "4"})) == 4.0
    assert retry_after_of(ClientError(503, {"retry-after": "5"})) == 5.0
    assert retry_after_of(ClientError(503)) is None
    built = HttpStatusError.from_response(429, {"Retry-After": "9"})
    assert (built.status_code, built.retry_after, built.retriable) == (429, 9.0, True)


def test_next_delay_honours_retry_after_over_a_shorter_backoff() -> None:
    policy = RetryPolicy(base_seconds=0.1, cap_seconds=1.0, rng=upper, wall_clock=lambda: NOW)
    assert policy.next_delay(1, HttpStatusError(503)) == 0.1
    assert policy.next_delay(1, HttpStatusError(429, retry_after=12)) == 12.0
    when = format_datetime(datetime.fromtimestamp(NOW + 20, UTC), usegmt=True)
    assert policy.next_delay(1, ClientError(503, {"Retry-After": when})) == pytest.approx(20.0)
    # A longer backoff is kept: Retry-After is a floor, not a replacement.
    assert RetryPolicy(base_seconds=8, rng=upper).next_delay(1, HttpStatusError(429, 2)) == 8


def test_next_delay_gives_up_on_permanent_errors_and_after_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3, rng=upper)
    assert policy.next_delay(1, HttpStatusError(404)) is None
    assert policy.next_delay(2, HttpStatusError(503)) is not None
    assert policy.next_delay(3, HttpStatusError(503)) is None


def test_max_total_delay_shortens_the_last_wait_then_gives_up() -> None:
    policy = RetryPolicy(base_seconds=1, cap_seconds=100, rng=upper, max_total_delay_seconds=5)
    assert policy.next_delay(1, Retryable("x"), elapsed=0) == 1
    assert policy.next_delay(3, Retryable("x"), elapsed=3) == 2  # 4 s backoff, 2 s left
    assert policy.next_delay(3, Retryable("x"), elapsed=5) is None
    # The server asks for more than is left: give up rather than ignore the server.
    assert policy.next_delay(1, HttpStatusError(429, retry_after=9), elapsed=1) is None


# ------------------------------------------------------------------ the Retrier


def test_retrier_retries_transient_failures_then_returns() -> None:
    t = FakeTime()
    outcomes: list[Exception | str] = [ConnectionResetError(), HttpStatusError(503), "ok"]

    def call() -> str:
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    retrier = Retrier(RetryPolicy(base_seconds=1, rng=upper), clock=t.clock, sleep=t.sleep)
    assert retrier.call(call) == "ok"
    assert t.slept == [1, 2]


def test_retrier_surfaces_permanent_errors_at_once() -> None:
    t = FakeTime()
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        raise HttpStatusError(422)

    with pytest.raises(HttpStatusError):
        Retrier(RetryPolicy(rng=upper), clock=t.clock, sleep=t.sleep).call(call)
    assert calls == 1 and t.slept == []


def test_retrier_stops_at_max_total_delay() -> None:
    t = FakeTime()
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        t.now += 0.5  # each attempt takes time too; it counts against the total
        raise TimeoutError()

    policy = RetryPolicy(
        base_seconds=1, cap_seconds=10, max_attempts=50, rng=upper, max_total_delay_seconds=6
    )
    with pytest.raises(TimeoutError):
        Retrier(policy, clock=t.clock, sleep=t.sleep).call(call)
    assert t.now <= 6.5 and sum(t.slept) <= 6
    assert calls == 4


def test_budget_exhaustion_fails_fast() -> None:
    t = FakeTime()
    budget = RetryBudget(ratio=0.0, burst=2, min_per_second=0, clock=t.clock)
    retrier = Retrier(
        RetryPolicy(max_attempts=10, rng=upper), budget=budget, clock=t.clock, sleep=t.sleep
    )
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionResetError()

    with pytest.raises(RetryBudgetExhausted) as info:
        retrier.call(failing)
    assert calls == 3  # first attempt + the 2 retries the budget had
    assert isinstance(info.value.__cause__, ConnectionResetError)
    with pytest.raises(RetryBudgetExhausted):
        retrier.call(failing)
    assert calls == 4  # the next call gets its first attempt but no retry


def test_open_circuit_is_not_retried_and_the_dependency_not_called() -> None:
    t = FakeTime()
    breaker = CircuitBreaker("psp", failure_threshold=2, recovery_seconds=30, clock=t.clock)
    retrier = Retrier(
        RetryPolicy(max_attempts=10, rng=lambda lo, hi: 0.0),
        breaker=breaker,
        clock=t.clock,
        sleep=t.sleep,
    )
    calls = 0

    def down() -> None:
        nonlocal calls
        calls += 1
        raise HttpStatusError(503)

    with pytest.raises(CircuitOpen) as info:
        retrier.call(down)
    assert calls == 2  # two failures opened it; the third attempt failed fast
    assert info.value.dependency == "psp" and info.value.retry_after == 30
    with pytest.raises(CircuitOpen):
        retrier.call(down)
    assert calls == 2


def test_on_retry_listener_sees_each_retry() -> None:
    t = FakeTime()
    seen: list[tuple[int, str, float]] = []
    outcomes = iter([TimeoutError("a"), TimeoutError("b"), None])

    def call() -> str:
        err = next(outcomes)
        if err is not None:
            raise err
        return "done"

    retrier = Retrier(
        RetryPolicy(base_seconds=1, rng=upper),
        clock=t.clock,
        sleep=t.sleep,
        on_retry=lambda n, e, d: seen.append((n, str(e), d)),
    )
    assert retrier.call(call) == "done"
    assert seen == [(1, "a", 1), (2, "b", 2)]


def test_async_retrier_applies_the_same_rules() -> None:
    t = FakeTime()
    outcomes: list[Exception | str] = [HttpStatusError(429, retry_after=3), "ok"]

    async def call() -> str:
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    retrier = Retrier(
        RetryPolicy(base_seconds=1, rng=upper), clock=t.clock, async_sleep=t.async_sleep
    )
    assert asyncio.run(retrier.call_async(call)) == "ok"
    assert t.slept == [3]

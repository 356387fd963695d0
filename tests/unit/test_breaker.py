"""Circuit breaker state machine with a fake clock (no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from outbox.errors import ConfigurationError
from outbox.resilience.breaker import BreakerState, CircuitBreaker, CircuitBreakers, CircuitOpen
from outbox.resilience.classify import HttpStatusError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fail(breaker: CircuitBreaker, exc: Exception | None = None) -> None:
    error = exc or ConnectionResetError()
    with pytest.raises(type(error)), breaker.guard():
        raise error


def succeed(breaker: CircuitBreaker) -> None:
    with breaker.guard():
        pass


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def transitions() -> list[tuple[str, str, str]]:
    return []


@pytest.fixture
def breaker(clock: Clock, transitions: list[tuple[str, str, str]]) -> CircuitBreaker:
    return CircuitBreaker(
        "psp",
        failure_threshold=3,
        recovery_seconds=10,
        clock=clock,
        on_state_change=lambda n, a, b: transitions.append((n, a.value, b.value)),
    )


def test_opens_after_threshold_consecutive_failures(breaker: CircuitBreaker) -> None:
    fail(breaker)
    fail(breaker)
    assert breaker.state is BreakerState.CLOSED
    fail(breaker)
    assert breaker.state is BreakerState.OPEN


def test_a_success_resets_the_consecutive_failure_count(breaker: CircuitBreaker) -> None:
    fail(breaker)
    fail(breaker)
    succeed(breaker)
    fail(breaker)
    fail(breaker)
    assert breaker.state is BreakerState.CLOSED


def test_client_errors_do_not_count_as_dependency_failures(breaker: CircuitBreaker) -> None:
    for _ in range(10):
        fail(breaker, HttpStatusError(404))
    assert breaker.state is BreakerState.CLOSED


def test_open_circuit_fails_fast_without_calling(breaker: CircuitBreaker, clock: Clock) -> None:
    for _ in range(3):
        fail(breaker)
    clock.now += 4
    called = False
    with pytest.raises(CircuitOpen) as info, breaker.guard():
        called = True
    assert not called
    assert info.value.retry_after == pytest.approx(6)
    assert info.value.retriable is False


def test_half_open_after_recovery_then_success_closes(
    breaker: CircuitBreaker, clock: Clock, transitions: list[tuple[str, str, str]]
) -> None:
    for _ in range(3):
        fail(breaker)
    clock.now += 10
    assert breaker.state is BreakerState.HALF_OPEN
    succeed(breaker)
    assert breaker.state is BreakerState.CLOSED
    assert transitions == [
        ("psp", "closed", "open"),
        ("psp", "open", "half_open"),
        ("psp", "half_open", "closed"),
    ]


def test_half_open_failure_reopens_for_a_full_recovery_period(
    breaker: CircuitBreaker, clock: Clock
) -> None:
    for _ in range(3):
        fail(breaker)
    clock.now += 10
    fail(breaker)
    assert breaker.state is BreakerState.OPEN
    clock.now += 9.9
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN


def test_half_open_admits_only_the_trial_calls(breaker: CircuitBreaker, clock: Clock) -> None:
    for _ in range(3):
        fail(breaker)
    clock.now += 10
    probe = breaker.acquire()
    with pytest.raises(CircuitOpen):
        breaker.acquire()  # one probe at a time (half_open_max_calls=1)
    breaker.record(probe, None)
    assert breaker.state is BreakerState.CLOSED


def test_cancelled_probe_gives_its_slot_back(breaker: CircuitBreaker, clock: Clock) -> None:
    for _ in range(3):
        fail(breaker)
    clock.now += 10

    async def cancelled() -> None:
        with breaker.guard():
            raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.acquire()  # the slot is free again


def test_stale_results_from_before_a_state_change_are_ignored(
    breaker: CircuitBreaker, clock: Clock
) -> None:
    slow = breaker.acquire()  # admitted while closed
    for _ in range(3):
        fail(breaker)
    clock.now += 10
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record(slow, None)  # a success from the old, closed era
    assert breaker.state is BreakerState.HALF_OPEN


def test_registry_keeps_one_breaker_per_dependency(clock: Clock) -> None:
    breakers = CircuitBreakers(failure_threshold=1, recovery_seconds=5, clock=clock)
    assert breakers.get("psp") is breakers.get("psp")
    fail(breakers.get("psp"))
    assert breakers.states() == {"psp": BreakerState.OPEN}
    succeed(breakers.get("ledger"))
    assert breakers.states()["ledger"] is BreakerState.CLOSED


def test_invalid_breaker_settings_are_rejected() -> None:
    with pytest.raises(ConfigurationError):
        CircuitBreaker("x", failure_threshold=0)

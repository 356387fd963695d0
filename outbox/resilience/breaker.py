"""Circuit breaker per dependency: closed -> open -> half-open -> closed.

A dependency that keeps failing is not called at all for ``recovery_seconds`` (the circuit
is *open*: calls fail fast with :class:`CircuitOpen`), then a few trial calls are let
through (*half-open*); one success closes the circuit, one failure opens it again.
Only retryable failures count (see :func:`outbox.resilience.classify.is_retryable`): a 4xx
answer means the dependency is up and the request was wrong, which says nothing about its
health.

``CircuitOpen`` is not retriable, so :class:`outbox.resilience.retry.Retrier` (and any caller using
``is_retryable``) never retries it: an open circuit is a state signal, not a blip, and
retrying it at an outer layer would rebuild the storm the breaker is there to stop.

Each admitted call carries the breaker's *generation*; results of calls admitted before the
last state change are ignored, so a slow call started while closed cannot close a circuit
that has since opened and gone half-open.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from outbox.errors import ConfigurationError, OutboxError
from outbox.resilience.classify import is_retryable

log = logging.getLogger("outbox.resilience.breaker")


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitOpen(OutboxError):
    """The dependency's circuit is open: the call was not made. Never retried by callers."""

    retriable = False

    def __init__(self, dependency: str, retry_after: float) -> None:
        super().__init__(
            f"circuit for {dependency!r} is open; not calling it for another {retry_after:.1f}s"
        )
        self.dependency = dependency
        self.retry_after = retry_after


@dataclass(frozen=True)
class Permit:
    """Admission of one call; hand it back to :meth:`CircuitBreaker.record`."""

    generation: int
    probe: bool


StateListener = Callable[[str, BreakerState, BreakerState], None]


class CircuitBreaker:
    """One dependency's breaker (thread-safe; usable from sync and async code)."""

    def __init__(
        self,
        name: str,
        failure_threshold: int = 5,
        recovery_seconds: float = 30.0,
        half_open_max_calls: int = 1,
        clock: Callable[[], float] = time.monotonic,
        on_state_change: StateListener | None = None,
    ) -> None:
        if failure_threshold < 1 or half_open_max_calls < 1 or recovery_seconds <= 0:
            raise ConfigurationError(
                "breaker needs failure_threshold >= 1, half_open_max_calls >= 1 and "
                "recovery_seconds > 0"
            )
        self.name = name
        self.failure_threshold = failure_threshold
        self.recovery_seconds = recovery_seconds
        self.half_open_max_calls = half_open_max_calls
        self._clock = clock
        self._on_state_change = on_state_change
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._failures = 0
        self._opened_at = 0.0
        self._probes = 0

    # -- state machine (callers hold self._lock) ----------------------------------------
    def _move(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        self._generation += 1
        self._failures = 0
        self._probes = 0
        if new is BreakerState.OPEN:
            self._opened_at = self._clock()
        log.warning("circuit %s: %s -> %s", self.name, old, new, extra={"dependency": self.name})
        if self._on_state_change is not None:
            self._on_state_change(self.name, old, new)

    def _tick(self) -> None:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self.recovery_seconds
        ):
            self._move(BreakerState.HALF_OPEN)

    # -- public -----------------------------------------------------------------------
    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._tick()
            return self._state

    def acquire(self) -> Permit:
        """Admit one call or raise :class:`CircuitOpen` (fail fast, dependency untouched)."""
        with self._lock:
            self._tick()
            if self._state is BreakerState.CLOSED:
                return Permit(self._generation, probe=False)
            if self._state is BreakerState.HALF_OPEN and self._probes < self.half_open_max_calls:
                self._probes += 1
                return Permit(self._generation, probe=True)
            wait = max(0.0, self._opened_at + self.recovery_seconds - self._clock())
            raise CircuitOpen(self.name, wait)

    def record(self, permit: Permit, exc: BaseException | None) -> None:
        """Report how an admitted call ended: ``None`` for success, else its exception."""
        with self._lock:
            if permit.generation != self._generation:
                return  # admitted before the last state change: says nothing about now
            failed = exc is not None and is_retryable(exc)
            if self._state is BreakerState.HALF_OPEN:
                self._move(BreakerState.OPEN if failed else BreakerState.CLOSED)
            elif failed:
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._move(BreakerState.OPEN)
            else:
                self._failures = 0

    def release(self, permit: Permit) -> None:
        """Give back a permit whose call ended without a verdict (e.g. it was cancelled)."""
        with self._lock:
            if permit.probe and permit.generation == self._generation:
                self._probes -= 1

    @contextmanager
    def guard(self) -> Iterator[None]:
        """``with breaker.guard(): call()`` — admit, then record the outcome.

        Works around ``await`` too. Cancellation and other non-``Exception`` exits give the
        permit back without counting as a success or a failure.
        """
        permit = self.acquire()
        try:
            yield
        except Exception as exc:
            self.record(permit, exc)
            raise
        except BaseException:
            self.release(permit)
            raise
        self.record(permit, None)


class CircuitBreakers:
    """One breaker per dependency name, created on first use with the same limits."""

    def __init__(
        self,
        failure_threshold: int = 5,
        recovery_seconds: float = 30.0,
        half_open_max_calls: int = 1,
        clock: Callable[[], float] = time.monotonic,
        on_state_change: StateListener | None = None,
        factory: Callable[[str], CircuitBreaker] | None = None,
    ) -> None:
        """``factory(dependency)``, when given, makes each breaker instead of the limits."""
        self._limits = (failure_threshold, recovery_seconds, half_open_max_calls)
        self._factory = factory
        self._clock = clock
        self._on_state_change = on_state_change
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, dependency: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(dependency)
            if breaker is None:
                if self._factory is not None:
                    breaker = self._factory(dependency)
                else:
                    breaker = CircuitBreaker(
                        dependency, *self._limits, self._clock, self._on_state_change
                    )
                self._breakers[dependency] = breaker
            return breaker

    def states(self) -> dict[str, BreakerState]:
        """Current state of every known dependency (for status output and metrics)."""
        with self._lock:
            breakers = list(self._breakers.values())
        return {b.name: b.state for b in breakers}

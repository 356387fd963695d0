"""A per-process retry budget: retries may add at most a fraction of the traffic.

Per-request attempt limits alone multiply load during an outage (5 attempts = 5x the
requests against a dependency that is already failing, times every replica). A budget caps
the *process-wide* retry rate instead: each request deposits ``ratio`` tokens, each retry
spends one, and a small time-based refill keeps a quiet process able to retry at all. When
the bucket is empty the caller fails fast instead of adding to the storm.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from outbox.errors import ConfigurationError, OutboxError


class RetryBudgetExhausted(OutboxError):
    """The process spent its retry budget; this failure is surfaced instead of retried.

    Not retriable: an outer layer retrying right away would defeat the budget.
    """

    retriable = False

    def __init__(self, attempts_made: int) -> None:
        super().__init__(
            f"retry budget exhausted after {attempts_made} attempt(s); failing fast "
            "(too many retries in this process relative to its requests)"
        )
        self.attempts_made = attempts_made


class RetryBudget:
    """Token bucket shared by every call in a process (thread-safe, clock injectable)."""

    def __init__(
        self,
        ratio: float = 0.1,
        burst: float = 10.0,
        min_per_second: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ratio < 0 or burst < 0 or min_per_second < 0:
            raise ConfigurationError("retry budget ratio, burst and refill must be >= 0")
        self.ratio = ratio
        self.burst = burst
        self.min_per_second = min_per_second
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = burst
        self._refilled_at = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._refilled_at)
        self._refilled_at = now
        self._tokens = min(self.burst, self._tokens + elapsed * self.min_per_second)

    def record_request(self) -> None:
        """Count one logical request (its first attempt); earns ``ratio`` retry tokens."""
        with self._lock:
            self._refill()
            self._tokens = min(self.burst, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        """Take one token for a retry; False (and nothing taken) when the budget is empty."""
        with self._lock:
            self._refill()
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    @property
    def available(self) -> float:
        """Tokens left now (a retry needs one)."""
        with self._lock:
            self._refill()
            return self._tokens

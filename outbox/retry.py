"""Retry policy shared by the relay, the inbox and users' own outbound calls.

Backoff is exponential with *full jitter*: ``sleep = uniform(0, min(cap, base * 2**attempt))``.
Jitter over the whole interval spreads retries of many replicas apart, so a recovering
dependency is not hit by synchronized waves (the retry-storm trap).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.errors import OutboxError
from outbox.settings import RetrySettings


class Permanent(OutboxError):
    """Raise (or subclass) to declare a failure that retrying cannot fix."""

    retriable = False


class Retryable(OutboxError):
    """Raise (or subclass) to declare a transient failure worth retrying."""

    retriable = True


def is_retryable(exc: BaseException) -> bool:
    """Classify an exception: its own ``retriable`` flag wins; unknown errors are retryable.

    Unknown exceptions default to retryable because the attempt budget bounds them anyway,
    while wrongly calling a transient fault permanent would dead-letter good work.
    """
    flag = getattr(exc, "retriable", None)
    if isinstance(flag, bool):
        return flag
    return not isinstance(exc, ValueError | TypeError | KeyError | LookupError)


@dataclass(frozen=True)
class RetryPolicy:
    base_seconds: float = 0.1
    cap_seconds: float = 30.0
    max_attempts: int = 5
    rng: Callable[[float, float], float] = field(default=random.uniform, compare=False)

    @classmethod
    def from_settings(cls, settings: RetrySettings) -> RetryPolicy:
        return cls(settings.base_seconds, settings.cap_seconds, settings.max_attempts)

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (0-based): full jitter under the cap."""
        ceiling = min(self.cap_seconds, self.base_seconds * 2 ** min(attempt, 62))
        return self.rng(0.0, ceiling)

    def should_retry(self, attempts_made: int, exc: BaseException) -> bool:
        """True when ``exc`` is retryable and fewer than ``max_attempts`` were made."""
        return attempts_made < self.max_attempts and is_retryable(exc)

"""Quiet outages: what a daemon logs while a dependency (the database, Kafka) is down.

A daemon has many tasks that notice the same outage (the relay's lane manager and each
pipeline, the consumer's partitions). They share one :class:`Dependency` per service, which
logs one line when it goes down, one when it comes back, and at most one reminder per
``remind_seconds`` in between — never one line per failed try. The failed tries are counted
(``failures`` / ``tries``) for status lines and metrics.

Third-party clients are as loud as they like during an outage (aiokafka logs every failed
connection, every ~200 ms); :func:`limit_third_party_logs` lets at most one of their warnings
through per ``remind_seconds`` unless the level is DEBUG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REMIND_SECONDS = 60.0
_THIRD_PARTY = ("aiokafka", "kafka")


class Dependency:
    """Up/down state of one external service, shared by a daemon's tasks."""

    def __init__(
        self,
        name: str,
        log: logging.Logger,
        *,
        down_message: str | None = None,
        up_message: str | None = None,
        on_change: Callable[[bool], None] | None = None,
        remind_seconds: float = REMIND_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._log = log
        self._down_message = down_message or f"{name} unavailable; retrying with backoff"
        self._up_message = up_message or f"{name} reachable again"
        self._on_change = on_change
        self._remind = remind_seconds
        self._clock = clock
        self.up = True
        self.failures = 0  # consecutive failed tries of the current outage
        self.tries = 0  # failed tries since start, every outage
        self.outages = 0
        self._down_at = 0.0
        self._reminded_at = 0.0

    def failed(self, error: BaseException | str) -> None:
        """One failed try; logs only when the state changes or a reminder is due."""
        self.failures += 1
        self.tries += 1
        now = self._clock()
        cause = error if isinstance(error, str) else (str(error) or type(error).__name__)
        if self.up:
            self.up = False
            self.outages += 1
            self._down_at = self._reminded_at = now
            self._log.warning(self._down_message, extra={"dependency": self.name, "error": cause})
            if self._on_change is not None:
                self._on_change(False)
        elif now - self._reminded_at >= self._remind:
            self._reminded_at = now
            self._log.warning(
                f"{self.name} still unavailable",
                extra={
                    "dependency": self.name,
                    "down_seconds": round(now - self._down_at),
                    "failed_tries": self.failures,
                    "error": cause,
                },
            )

    def ok(self) -> None:
        """A successful call; logs once when the dependency is back."""
        if not self.up:
            self.up = True
            self._log.info(
                self._up_message,
                extra={
                    "dependency": self.name,
                    "down_seconds": round(self._clock() - self._down_at, 1),
                    "failed_tries": self.failures,
                },
            )
            if self._on_change is not None:
                self._on_change(True)
        self.failures = 0


class _ThirdPartyLimit(logging.Filter):
    """At most one record of the third-party loggers per ``seconds`` (all of them together:
    one outage makes them repeat the same complaint in many forms)."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        super().__init__()
        self._seconds = seconds
        self._clock = clock
        self._last = -seconds

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(_THIRD_PARTY):
            return True
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        now = self._clock()
        if now - self._last < self._seconds:
            return False
        self._last = now
        return True


def limit_third_party_logs(
    seconds: float = REMIND_SECONDS, clock: Callable[[], float] = time.monotonic
) -> None:
    """Rate-limit aiokafka's log records on every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _ThirdPartyLimit) for f in handler.filters):
            handler.addFilter(_ThirdPartyLimit(seconds, clock))

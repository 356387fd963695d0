"""Is Kafka reachable? One shared state for all pipelines of a relay, so an outage gives
one log line when it starts and one when it ends — not one per batch (no log storm) — and
every pipeline backs off with the same full-jitter policy. Attempts are never counted for
an outage: that is decided per row by the pipeline, this only decides when to try again."""

from __future__ import annotations

import logging

from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from relay.metrics import RelayMetrics

log = logging.getLogger("relay.kafka")


class KafkaState:
    def __init__(self, retry: RetryPolicy, metrics: RelayMetrics) -> None:
        self._retry = retry
        self._state = Dependency(
            "Kafka",
            log,
            down_message="Kafka unavailable; holding rows in the outbox and backing off",
            up_message="Kafka reachable again; resuming",
            on_change=lambda up: metrics.kafka_up.set(1 if up else 0),
        )
        metrics.kafka_up.set(1)

    @property
    def up(self) -> bool:
        return self._state.up

    @property
    def failures(self) -> int:
        return self._state.failures

    def failed(self, exc: BaseException) -> None:
        self._state.failed(exc)

    def ok(self) -> None:
        self._state.ok()

    def backoff(self) -> float:
        """Full-jitter delay before the next try (0 while Kafka is up)."""
        return 0.0 if self.up else self._retry.backoff(self.failures - 1)

"""Is Kafka reachable? One shared state for all pipelines of a relay, so an outage gives
one log line when it starts and one when it ends — not one per batch (no log storm) — and
every pipeline backs off with the same full-jitter policy. Attempts are never counted for
an outage: that is decided per row by the pipeline, this only decides when to try again."""

from __future__ import annotations

import logging

from outbox.retry import RetryPolicy
from relay.metrics import RelayMetrics

log = logging.getLogger("relay.kafka")


class KafkaState:
    def __init__(self, retry: RetryPolicy, metrics: RelayMetrics) -> None:
        self._retry = retry
        self._metrics = metrics
        self.up = True
        self.failures = 0
        metrics.kafka_up.set(1)

    def failed(self, exc: BaseException) -> None:
        if self.up:
            log.warning(
                "Kafka unavailable; holding rows in the outbox and backing off",
                extra={"error": str(exc)},
            )
            self.up = False
            self._metrics.kafka_up.set(0)
        self.failures += 1

    def ok(self) -> None:
        if not self.up:
            log.info("Kafka reachable again; resuming", extra={"failed_tries": self.failures})
            self.up = True
            self._metrics.kafka_up.set(1)
        self.failures = 0

    def backoff(self) -> float:
        """Full-jitter delay before the next try (0 while Kafka is up)."""
        return 0.0 if self.up else self._retry.backoff(self.failures - 1)

"""Is Kafka reachable? One shared state for all pipelines of a relay, so an outage gives
one log line when it starts and one when it ends — not one per batch (no log storm) — and
every pipeline backs off with the same full-jitter policy. Attempts are never counted for
an outage: that is decided per row by the pipeline, this only decides when to try again."""

from __future__ import annotations

import logging

from outbox.errors import ProducerBroken
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from relay.errors import PartitionUnavailable
from relay.kafka.outcome import Outcome
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

    def record(
        self, outcome: Outcome, rows: int, seconds: float, metrics: RelayMetrics, quiet: bool
    ) -> None:
        """A publish of ``rows`` rows that took ``seconds``: its metrics, and whether it
        says Kafka is up or down. Down when it answers nothing: the publish failed as a
        whole, or (``quiet``: no partition at all was acknowledged for a whole ack timeout)
        its partitions are unavailable. Some sick partitions are the publisher's business
        (logged and counted per partition)."""
        metrics.batch_size.observe(rows)
        metrics.batch_seconds.observe(seconds)
        metrics.published.inc(len(outcome.acked))
        for exc in outcome.failed.values():
            metrics.errors.labels(type(exc).__name__).inc()
        if outcome.acked:
            self.ok()
            return
        transient = outcome.transient
        if isinstance(transient, ProducerBroken):
            transient = None  # the publisher replaced that producer; its rows go again
        if transient is None and quiet:
            unavailable = [
                e for e in outcome.failed.values() if isinstance(e, PartitionUnavailable)
            ]
            transient = unavailable[0] if unavailable else None
        if transient is not None:
            self.failed(transient)

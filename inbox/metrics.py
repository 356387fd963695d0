"""Prometheus metrics of one running consumer (own registry, so tests can run several)."""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Counter name (outbox_inbox_<name>_total) -> help text.
COUNTERS = {
    "processed": "Events whose handler committed.",
    "duplicates": "Redelivered events skipped by dedupe.",
    "retries": "Handler attempts retried after an error.",
    "dead_lettered": "Events sent to a dead-letter topic.",
    "dead_letters_refused": "Dead letters Kafka refused as too large for their dead-letter "
    "topic (kept in the database; a marker without the value sent instead).",
    "skipped": "Unknown or malformed events skipped by policy.",
    "stale": "Events older than their key's applied sequence, skipped by the guard.",
    "transactions": "Handler transactions committed; processed / transactions is the "
    "events per transaction (see OUTBOX_CONSUMER__LINGER_MS).",
}


@dataclass
class Metrics:
    consumer: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        # Label lookups take a lock and a dict probe, so the hot path uses the children.
        # Made here, every series is exported at 0 from the start: dashboards never show
        # "no data" and increase() sees the first event.
        self._children = {
            name: Counter(
                f"outbox_inbox_{name}_total", doc, ["consumer"], registry=self.registry
            ).labels(self.consumer)
            for name, doc in COUNTERS.items()
        }
        self._handler_seconds = Histogram(
            "outbox_inbox_handler_seconds",
            "Handler run time (without the commit).",
            ["consumer"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        ).labels(self.consumer)
        self._batch_size = Histogram(
            "outbox_inbox_batch_size",
            "Events per call of a batch handler (duplicates and stale events left out).",
            ["consumer"],
            registry=self.registry,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
        ).labels(self.consumer)
        # Calls of batch handlers, and the events they carried (for tests and benchmarks).
        self.batch_calls = self.batch_events = 0
        self._refused_by_topic: Tally[str] = Tally()  # which topic: in the log line
        self.counts = dict.fromkeys(COUNTERS, 0)
        # One series per partition while this member has it assigned.
        self._lag = Gauge(
            "outbox_inbox_lag_records",
            "Records of an assigned partition after the offset this consumer committed "
            "(high watermark minus committed offset).",
            ["consumer", "topic", "partition"],
            registry=self.registry,
        )

    def _inc(self, name: str, n: int) -> None:
        if n:
            self._children[name].inc(n)
            self.counts[name] += n

    def processed(self, n: int = 1) -> None:
        self._inc("processed", n)

    def duplicates(self, n: int = 1) -> None:
        self._inc("duplicates", n)

    def retries(self, n: int = 1) -> None:
        self._inc("retries", n)

    def dead_lettered(self, n: int = 1) -> None:
        self._inc("dead_lettered", n)

    def skipped(self, n: int = 1) -> None:
        self._inc("skipped", n)

    def stale(self, n: int = 1) -> None:
        self._inc("stale", n)

    def dead_letter_refused(self, topic: str) -> int:
        """Count a dead letter ``topic`` refused as too large; returns how many it has
        refused so far (1: the first, worth a log line)."""
        self._inc("dead_letters_refused", 1)
        self._refused_by_topic[topic] += 1
        return self._refused_by_topic[topic]

    def transactions(self, n: int = 1) -> None:
        self._inc("transactions", n)

    def handler_seconds(self, seconds: float) -> None:
        self._handler_seconds.observe(seconds)

    def handler_seconds_total(self) -> float:
        """Every handler run's time added up (the histogram's sum; read off the hot path)."""
        value = self.registry.get_sample_value(
            "outbox_inbox_handler_seconds_sum", {"consumer": self.consumer}
        )
        return value or 0.0

    def batch_size(self, events: int) -> None:
        """One call of a batch handler with ``events`` events."""
        self._batch_size.observe(events)
        self.batch_calls += 1
        self.batch_events += events

    def lag(self, topic: str, partition: int, records: int) -> None:
        self._lag.labels(self.consumer, topic, str(partition)).set(records)

    def forget_lag(self, topic: str, partition: int) -> None:
        with contextlib.suppress(KeyError):
            self._lag.remove(self.consumer, topic, str(partition))

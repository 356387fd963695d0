"""Prometheus metrics of one running consumer (own registry, so tests can run several)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram


@dataclass
class Metrics:
    consumer: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"outbox_inbox_{name}", doc, ["consumer"], registry=self.registry)

        self._processed = counter("processed_total", "Events whose handler committed.")
        self._duplicates = counter("duplicates_total", "Redelivered events skipped by dedupe.")
        self._retries = counter("retries_total", "Handler attempts retried after an error.")
        self._dead = counter("dead_lettered_total", "Events sent to a dead-letter topic.")
        self._skipped = counter("skipped_total", "Unknown or malformed events skipped by policy.")
        self._latency = Histogram(
            "outbox_inbox_handler_seconds",
            "Handler run time (without the commit).",
            ["consumer"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )
        self.counts = {
            "processed": 0,
            "duplicates": 0,
            "retries": 0,
            "dead_lettered": 0,
            "skipped": 0,
        }

        # Label lookups take a lock and a dict probe; the hot path uses the children.
        self._handler_seconds = self._latency.labels(self.consumer)

    def _inc(self, name: str, counter: Counter, n: int) -> None:
        if n:
            counter.labels(self.consumer).inc(n)
            self.counts[name] += n

    def processed(self, n: int = 1) -> None:
        self._inc("processed", self._processed, n)

    def duplicates(self, n: int = 1) -> None:
        self._inc("duplicates", self._duplicates, n)

    def retries(self, n: int = 1) -> None:
        self._inc("retries", self._retries, n)

    def dead_lettered(self, n: int = 1) -> None:
        self._inc("dead_lettered", self._dead, n)

    def skipped(self, n: int = 1) -> None:
        self._inc("skipped", self._skipped, n)

    def handler_seconds(self, seconds: float) -> None:
        self._handler_seconds.observe(seconds)

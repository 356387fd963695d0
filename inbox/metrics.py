"""Prometheus metrics of one running consumer (own registry, so tests can run several)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

# Counter name (outbox_inbox_<name>_total) -> help text.
COUNTERS = {
    "processed": "Events whose handler committed.",
    "duplicates": "Redelivered events skipped by dedupe.",
    "retries": "Handler attempts retried after an error.",
    "dead_lettered": "Events sent to a dead-letter topic.",
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
        self.counts = dict.fromkeys(COUNTERS, 0)

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

    def transactions(self, n: int = 1) -> None:
        self._inc("transactions", n)

    def handler_seconds(self, seconds: float) -> None:
        self._handler_seconds.observe(seconds)

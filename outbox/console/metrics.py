"""Prometheus metrics of the console (its own registry, served at its ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ConsoleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.actions = Counter(
            "outbox_console_actions",
            "Actions taken in the console, by action: dlq.replay, dlq.purge, failed.retry, "
            "failed.discard, effects.applied, effects.not_applied, effects.give_up.",
            ["action"],
            registry=registry,
        )
        self.items = Counter(
            "outbox_console_action_items",
            "Items (dead letters, failed rows, effects) the console's actions touched.",
            ["action"],
            registry=registry,
        )

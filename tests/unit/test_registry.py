"""once_per_registry: one metrics object per registry, never one bound to a dropped registry."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Counter

from outbox.registry import once_per_registry


def make(registry: CollectorRegistry) -> Counter:
    return Counter("outbox_test_made", "test counter", registry=registry)


def test_same_registry_same_object() -> None:
    registry = CollectorRegistry()
    assert once_per_registry(make, registry) is once_per_registry(make, registry)


def test_a_new_registry_gets_its_own_metrics_even_at_a_reused_address() -> None:
    # Registries created and dropped in a loop reuse addresses; each must count into itself.
    # gc.collect(1): the young generations hold what this loop made; a full collection of
    # the whole suite's heap cost 0.5 s each (25 s in CI).
    addresses = []
    for _ in range(50):
        registry = CollectorRegistry()
        addresses.append(id(registry))
        once_per_registry(make, registry).inc()
        assert registry.get_sample_value("outbox_test_made_total") == 1
        del registry
        gc.collect(1)
    assert len(set(addresses)) < len(addresses)  # an address was reused: the case tested

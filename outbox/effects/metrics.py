"""Prometheus metrics of the effect ledger.

Effects run inside the user's own process: the metrics go to its registry, once (see
:mod:`outbox.registry`), shared by every :class:`~outbox.effects.Effects` of the process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from outbox.registry import once_per_registry
from outbox.resilience.breaker import BreakerState

# Gauge values of a breaker's state.
BREAKER_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class EffectMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "outbox_effects_calls",
            "Calls made to a dependency by the effect ledger, by how they ended: ok, "
            "retryable (provably not applied), permanent, ambiguous (may have been applied).",
            ["dependency", "outcome"],
            registry=registry,
        )
        self.replays = Counter(
            "outbox_effects_replays",
            "Callers answered from the ledger without a call: the stored result (done) or the "
            "stored permanent failure (failed).",
            ["state"],
            registry=registry,
        )
        self.reconciliations = Counter(
            "outbox_effects_reconciliations",
            "reconcile(key) calls after an ambiguous attempt or a dead caller, by answer: "
            "applied, not_applied, error.",
            ["result"],
            registry=registry,
        )
        self.unknown = Counter(
            "outbox_effects_unknown_outcomes",
            "Effects parked in state unknown (ambiguous, nothing to reconcile with): each "
            "needs an operator's `outbox effects resolve`.",
            registry=registry,
        )
        self.conflicts = Counter(
            "outbox_effects_conflicts",
            "Callers that reused a key with other arguments (rejected).",
            registry=registry,
        )
        self.in_progress = Counter(
            "outbox_effects_in_progress",
            "Callers told the key is in progress elsewhere (they may retry later).",
            registry=registry,
        )
        self.breaker_state = Gauge(
            "outbox_effects_breaker_state",
            "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open.",
            ["dependency"],
            registry=registry,
        )
        # Exported at 0 from the start, so dashboards and rate() see the series at once.
        for state in ("done", "failed"):
            self.replays.labels(state)
        for result in ("applied", "not_applied", "error"):
            self.reconciliations.labels(result)

    def breaker_is(self, dependency: str, state: BreakerState) -> None:
        self.breaker_state.labels(dependency).set(BREAKER_VALUES[state])


def effect_metrics(registry: CollectorRegistry | None = None) -> EffectMetrics:
    """The metrics of ``registry`` (default: prometheus-client's global one)."""
    return once_per_registry(EffectMetrics, registry)

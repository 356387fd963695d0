"""Prometheus counters of idempotent requests, by outcome.

Idempotent requests run inside the user's own web process: the counters go to its
registry, once (see :mod:`outbox.registry`), shared by every ``IdempotencyKeys``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from outbox.idempotency.errors import (
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyLockLost,
)
from outbox.registry import once_per_registry

OUTCOMES = (
    "created",
    "replayed",
    "failed",
    "released",
    "conflict",
    "in_progress",
    "lock_lost",
    "error",
)
# Most specific first: a lost lock is also "in progress".
_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (IdempotencyConflict, "conflict"),
    (IdempotencyLockLost, "lock_lost"),
    (IdempotencyInProgress, "in_progress"),
)


class Recorder:
    """What one request ended with; counted once."""

    def __init__(self, metrics: IdempotencyMetrics) -> None:
        self._metrics = metrics
        self.counted = False

    def outcome(self, outcome: Any) -> None:
        """The request returned ``outcome`` (an :class:`~outbox.idempotency.keys.Outcome`)."""
        self.count("replayed" if outcome.replayed else "created" if outcome.stored else "released")

    def count(self, kind: str) -> None:
        self._metrics.count(kind)
        self.counted = True


class IdempotencyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter(
            "outbox_idempotency_requests",
            "Idempotent requests by outcome: created (ran, response stored), replayed (stored "
            "response returned), failed (permanent failure stored), released (transient "
            "failure, key freed), conflict (same key, other payload), in_progress, lock_lost, "
            "error (the database or another fault before the operation ran).",
            ["outcome"],
            registry=registry,
        )
        # Every outcome exported at 0 from the start, so dashboards never show "no data".
        self._children = {o: self._requests.labels(o) for o in OUTCOMES}

    def count(self, outcome: str) -> None:
        self._children[outcome].inc()

    @contextlib.contextmanager
    def request(self) -> Iterator[Recorder]:
        """Count one request exactly once: by what the body recorded, else by the kind of
        exception that left it (re-raised)."""
        recorder = Recorder(self)
        try:
            yield recorder
        except Exception as exc:
            if not recorder.counted:
                kind = next((k for t, k in _ERRORS if isinstance(exc, t)), "error")
                recorder.count(kind)
            raise


def metrics_for(registry: CollectorRegistry | None = None) -> IdempotencyMetrics:
    """The counters of ``registry`` (default: prometheus-client's global one)."""
    return once_per_registry(IdempotencyMetrics, registry)

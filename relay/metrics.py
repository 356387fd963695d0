"""Prometheus metrics of one relay, and the HTTP endpoint serving them plus ``/healthz``.

Each relay has its own ``CollectorRegistry`` so that several relays in one process (tests,
benchmarks) never collide on metric names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published",
            "Events acknowledged by Kafka and removed/marked.",
            registry=r,
        )
        self.batch_size = Histogram(
            "outbox_relay_batch_size",
            "Rows per claimed batch.",
            registry=r,
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 5000, 10000),
        )
        self.batch_seconds = Histogram(
            "outbox_relay_batch_seconds",
            "Claim to commit time of a batch.",
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.errors = Counter("outbox_relay_errors", "Errors by class.", ["error"], registry=r)
        self.failed = Counter(
            "outbox_relay_moved_to_failed", "Rows moved to the failed table.", registry=r
        )
        self.owned_lanes = Gauge("outbox_relay_owned_lanes", "Lanes this relay owns.", registry=r)
        self.pending = Gauge(
            "outbox_relay_pending_events", "Rows waiting in the outbox (all lanes).", registry=r
        )
        self.oldest_age = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest pending row, by the database clock.",
            registry=r,
        )
        self.kafka_up = Gauge("outbox_relay_kafka_up", "1 when Kafka acknowledges.", registry=r)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line."""


def serve(
    metrics: RelayMetrics, port: int, healthy: Callable[[], bool], host: str = "0.0.0.0"
) -> WSGIServer:
    """Serve ``/metrics`` and ``/healthz`` (200 when healthy, else 503) on a daemon thread."""
    prometheus = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            ok = healthy()
            start("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"unhealthy\n"]
        result: Iterable[bytes] = prometheus(environ, start)
        return result

    server = make_server(host, port, app, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="relay-metrics", daemon=True).start()
    return server

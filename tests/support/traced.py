"""Run a program with an OpenTelemetry SDK that writes every finished span to a file.

    python -m tests.support.traced SPANS_FILE cli relay ...        # the outbox CLI
    python -m tests.support.traced SPANS_FILE publish TOPIC PAYLOADS_JSON   # test producer
    python -m tests.support.traced SPANS_FILE idempotent TOPIC KEY  # a request, then its retry

The library only uses the OpenTelemetry API; this is what an application does to record
traces: set a provider with an exporter before running. Each span is one JSON line,
written when it ends (SimpleSpanProcessor), so a SIGTERM'd daemon loses none.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in shutdown)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                self._file.write(span.to_json(indent=None) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


def configure(path: str, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(path)))
    trace.set_tracer_provider(provider)
    return provider


def publish(topic: str, payloads: list[dict[str, Any]]) -> None:
    """Publish each payload in its own transaction, inside a "checkout" span (the request
    that publishes the event); prints {event_id: trace_id} as JSON. A payload's "type"
    field, if any, is its event type (default order.created)."""
    from sqlalchemy import create_engine

    from outbox import Outbox, OutboxSettings

    settings = OutboxSettings()
    outbox = Outbox(settings)
    engine = create_engine(settings.database_url.get_secret_value())
    tracer = trace.get_tracer("checkout-service")
    out = {}
    for payload in payloads:
        with tracer.start_as_current_span("checkout") as span, engine.begin() as conn:
            event_type = payload.pop("type", "order.created")
            event_id = outbox.publish(
                conn, topic=topic, key="k", event_type=event_type, payload=payload
            )
        out[str(event_id)] = format(span.get_span_context().trace_id, "032x")
    engine.dispose()
    print(json.dumps(out))


def idempotent(topic: str, key: str) -> None:
    """The same idempotent request twice, each in its own "request" span: the first runs
    (and publishes), the second replays; prints the request spans' trace ids."""
    from sqlalchemy import create_engine

    from outbox import Outbox, OutboxSettings
    from outbox.idempotency import IdempotencyKeys, StoredResponse

    settings = OutboxSettings()
    outbox, keys = Outbox(settings), IdempotencyKeys(settings)
    engine = create_engine(settings.database_url.get_secret_value())
    tracer = trace.get_tracer("refund-service")

    def operation(session: Any) -> StoredResponse:
        outbox.publish(session, topic=topic, event_type="refund.created", payload={"key": key})
        return StoredResponse.json(201, {"ok": True})

    traces = []
    for _ in range(2):
        with tracer.start_as_current_span("request") as span:
            keys.run(engine, scope="tenant-1", key=key, payload={"a": 1}, operation=operation)
        traces.append(format(span.get_span_context().trace_id, "032x"))
    engine.dispose()
    print(json.dumps(traces))


def main(argv: list[str]) -> None:
    path, mode, *rest = argv
    provider = configure(path, service=mode if mode != "cli" else rest[0])
    try:
        if mode == "publish":
            publish(rest[0], json.loads(rest[1]))
        elif mode == "idempotent":
            idempotent(rest[0], rest[1])
        else:
            from cli.app import main as cli_main

            sys.argv = ["outbox", *rest]
            cli_main()
    finally:
        provider.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])

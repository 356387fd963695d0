"""Tracing on or off for the benches: ``BENCH_TRACE=1`` turns it on.

On means what an application with the ``otel`` extra does: an SDK ``TracerProvider``
with a ``BatchSpanProcessor``; its exporter drops the spans, so the figure is the cost of
creating and processing them, not of shipping them. Records and rows then carry a
``traceparent``, so the relay links and the consumer parents every span.

    BENCH_TRACE=1 python -m bench.relay ...      # relays start through this module:
    python -m bench.tracing --log-level WARNING relay
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def enabled() -> bool:
    return os.environ.get("BENCH_TRACE") == "1"


def setup() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)


if __name__ == "__main__":
    setup()
    from cli.app import main

    sys.argv = ["outbox", *sys.argv[1:]]
    main()

"""A batch handler's call is one span linked to each event's producer trace.

Run in a subprocess: an OpenTelemetry tracer provider can be set only once per process,
and the rest of the test session must keep tracing off.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECKS = textwrap.dedent(
    """
    import time

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from inbox import tracing
    from inbox.event import InboxEvent

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    time.sleep(1.05)  # "tracing off" is cached for up to a second

    def event(n, traced=True):
        parent = f"00-{n:032x}-{n:016x}-01"
        headers = (("traceparent", parent.encode()),) if traced else ()
        return InboxEvent(f"e{n}", "t", "orders", 0, n, b"k", b"{}", headers)

    events = [event(1), event(2, traced=False), event(3)]
    with tracing.batch(events, "billing"):
        pass
    try:
        with tracing.batch(events[:1], "billing"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    many = [event(n) for n in range(1, 201)]
    with tracing.batch(many, "billing"):
        pass
    ok, failed, big = exporter.get_finished_spans()
    assert ok.name == "process orders", ok.name
    assert ok.attributes["messaging.batch.message_count"] == 3
    assert ok.attributes["messaging.consumer.group.name"] == "billing"
    assert [(l.context.trace_id, l.attributes["messaging.message.id"]) for l in ok.links] == [
        (1, "e1"),
        (3, "e3"),
    ]
    assert ok.parent is None  # a trace of its own: a list spans many traces
    assert failed.status.status_code.name == "ERROR"
    assert failed.attributes["error.type"] == "RuntimeError"
    assert len(big.links) == tracing.MAX_LINKS
    assert big.attributes[tracing.LINKS_DROPPED] == 200 - tracing.MAX_LINKS
    print("ok")
    """
)


def test_a_batch_span_links_every_traced_event_and_records_failure() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "ok", result.stderr

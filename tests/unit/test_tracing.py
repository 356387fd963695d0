"""outbox.tracing's publish-side hook and the handler-signature rules for EventContext.

The tracing checks run in a subprocess: an OpenTelemetry tracer provider can be set only
once per process, and the rest of the test session must keep tracing off.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from inbox import Consumer, EventContext, HandlerConfigurationError

ROOT = Path(__file__).resolve().parents[2]

_CHECKS = textwrap.dedent(
    """
    import time

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from outbox import tracing
    from outbox.envelope import Message

    plain = Message(topic="t", payload={}, event_type="e")
    mine = Message(topic="t", payload={}, event_type="e", headers={"traceparent": "00-x"})
    assert not tracing.active()
    assert tracing.with_trace_context([plain]) == [plain]  # tracing off: untouched

    trace.set_tracer_provider(TracerProvider())
    time.sleep(1.05)  # "tracing off" is cached for up to a second
    assert tracing.active()
    assert list(tracing.with_trace_context([plain])) == [plain]  # no current span
    with trace.get_tracer("t").start_as_current_span("request") as span:
        added, kept = tracing.with_trace_context([plain, mine])
    trace_id = format(span.get_span_context().trace_id, "032x")
    span_id = format(span.get_span_context().span_id, "016x")
    assert added.headers["traceparent"].startswith(f"00-{trace_id}-{span_id}-"), added.headers
    assert kept.headers == {"traceparent": "00-x"}  # the caller's own context wins
    extracted = tracing.extract_record([("traceparent", added.headers["traceparent"].encode())])
    assert trace.get_current_span(extracted).get_span_context().trace_id == int(trace_id, 16)
    print("ok")
    """
)


def test_publish_adds_the_current_trace_context_unless_the_caller_set_one() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "ok", result.stderr


class Paid(BaseModel):
    order_id: str


def test_a_third_parameter_typed_event_context_receives_the_metadata() -> None:
    app = Consumer(name="c", topics=["t"])

    @app.handler("paid")
    async def with_context(event: Paid, session: object, ctx: EventContext) -> None: ...

    @app.handler("plain")
    async def without(event: Paid, session: object, extra: int = 0) -> None: ...

    assert app.handlers["paid"].wants_context and app.handlers["paid"].model is Paid
    assert not app.handlers["plain"].wants_context


def test_a_third_parameter_of_another_type_is_refused() -> None:
    app = Consumer(name="c", topics=["t"])
    with pytest.raises(HandlerConfigurationError, match="EventContext"):

        @app.handler("paid")
        async def wrong(event: Paid, session: object, ctx: dict[str, str]) -> None: ...

"""The relay's span: one ``send`` span per batch, linked to every message's trace.

A batch carries events from many requests (many traces), so the span cannot be a child of
all of them; following the messaging semantic conventions it starts its own trace and
links to each message's creation context. The record keeps the producer's
``traceparent``, so the consumer's span continues the producer's trace, not the relay's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from outbox import tracing
from relay.event import CE_ID, HEADERS, TOPIC, Event
from relay.kafka.outcome import Outcome

if TYPE_CHECKING:
    from opentelemetry.trace import Span


# The SDK keeps 128 links per span unless configured otherwise
# (OTEL_SPAN_LINK_COUNT_LIMIT); building more for a 2,000-row batch would only cost time.
MAX_LINKS = 128
LINKS_DROPPED = "outbox.relay.links_dropped"


def start_send(rows: Sequence[Event]) -> Span | None:
    """Start the batch's send span (None when tracing is off)."""
    if not tracing.active():
        return None
    from opentelemetry.trace import Link, SpanKind

    topics = {row[TOPIC] for row in rows}
    attributes: dict[str, str | int] = {
        tracing.SYSTEM: "kafka",
        tracing.OPERATION_TYPE: "send",
        tracing.OPERATION_NAME: "send",
        tracing.BATCH_COUNT: len(rows),
    }
    name = "send"
    if len(topics) == 1:
        (topic,) = topics
        attributes[tracing.DESTINATION] = topic
        name = f"send {topic}"
    links = []
    for row in rows:
        headers: str = row[HEADERS]
        if tracing.TRACEPARENT not in headers:
            continue  # cheap test on the JSON text before parsing it
        context = tracing.span_context(json.loads(headers).get(tracing.TRACEPARENT))
        if context is not None:
            links.append(Link(context, {tracing.MESSAGE_ID: row[CE_ID]}))
            if len(links) == MAX_LINKS:
                attributes[LINKS_DROPPED] = len(rows) - MAX_LINKS
                break
    return tracing.tracer().start_span(
        name, kind=SpanKind.PRODUCER, attributes=attributes, links=links
    )


def end_send(span: Span | None, outcome: Outcome | None) -> None:
    """Record what Kafka made of the batch and end the span."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    if outcome is not None:
        span.set_attribute("outbox.relay.acked", len(outcome.acked))
        if outcome.failed:
            span.set_attribute("outbox.relay.failed", len(outcome.failed))
            first = next(iter(outcome.failed.values()))
            span.set_attribute(tracing.ERROR_TYPE, type(first).__name__)
            span.set_status(Status(StatusCode.ERROR, str(first)[:200]))
    span.end()

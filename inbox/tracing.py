"""The consumer's spans: one ``process`` span per handler run, a child of the producer's
trace (extracted from the record's ``traceparent``), with the messaging attributes; a
batch handler's call gets one span linked to every event's trace.

Outcomes are marked on the spans: a handler error sets status ERROR with the exception
recorded; a retry is a new span with ``outbox.attempt`` > 1 and a ``retry`` event; a
redelivered event skipped by the inbox gets a span with ``outbox.duplicate``; a dead
letter gets a span with ``outbox.dead_letter``, its reason and a ``dead_lettered`` event.
Every hook returns at once when tracing is off (see :func:`outbox.tracing.active`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from inbox.event import InboxEvent
from inbox.failures import Failure
from outbox import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def _attributes(event: InboxEvent, consumer: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        tracing.SYSTEM: "kafka",
        tracing.OPERATION_TYPE: "process",
        tracing.OPERATION_NAME: "process",
        tracing.DESTINATION: event.topic,
        tracing.PARTITION: str(event.partition),
        tracing.KAFKA_OFFSET: event.offset,
        tracing.MESSAGE_ID: event.event_id,
        tracing.CONSUMER_GROUP: consumer,
    }
    if event.key is not None:
        attributes[tracing.KAFKA_KEY] = event.key.decode("utf-8", errors="replace")
    return attributes


def carrier(event: InboxEvent) -> tuple[tuple[str, bytes], ...]:
    """Where the producer's trace context is: the record's headers, and for a structured
    CloudEvent its ``traceparent``/``tracestate`` attributes (the distributed tracing
    extension, e.g. Dapr's), which win."""
    if event.attributes is None:
        return event.headers
    inside = tuple(
        (name, value.encode())
        for name, value in event.attributes
        if name in (tracing.TRACEPARENT, tracing.TRACESTATE)
    )
    return event.headers + inside if inside else event.headers


def _start(event: InboxEvent, consumer: str, attributes: dict[str, Any]) -> Span:
    from opentelemetry.trace import SpanKind

    return tracing.tracer().start_span(
        f"process {event.topic}",
        context=tracing.extract_record(carrier(event)),
        kind=SpanKind.CONSUMER,
        attributes={**_attributes(event, consumer), **attributes},
    )


def process(event: InboxEvent, consumer: str, attempt: int) -> AbstractContextManager[Any]:
    """Around one handler run: the process span, current while the handler runs (so what
    the handler publishes continues the trace)."""
    if not tracing.active():
        return _OFF
    return _Process(event, consumer, attempt)


class _Process:
    """The process span of one handler run (a class, not a generator: it runs per event)."""

    __slots__ = ("_span", "_token")

    def __init__(self, event: InboxEvent, consumer: str, attempt: int) -> None:
        self._span = _start(event, consumer, {tracing.ATTEMPT: attempt})
        if attempt > 1:
            self._span.add_event("retry", {tracing.ATTEMPT: attempt})

    def __enter__(self) -> Span:
        from opentelemetry import context, trace

        self._token = context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        from opentelemetry import context

        context.detach(self._token)
        if isinstance(exc, Exception):
            from opentelemetry.trace import Status, StatusCode

            self._span.record_exception(exc)
            self._span.set_attribute(tracing.ERROR_TYPE, type(exc).__qualname__)
            self._span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
        self._span.end()


# The SDK keeps 128 links per span unless configured otherwise (OTEL_SPAN_LINK_COUNT_LIMIT):
# building more for a 1,000-event call would only cost time.
MAX_LINKS = 128
LINKS_DROPPED = "outbox.links_dropped"


def batch(events: Sequence[InboxEvent], consumer: str) -> AbstractContextManager[Any]:
    """Around one call of a batch handler: one process span of its own trace, linked to
    each event's producer trace (a list spans many traces, so it cannot be a child of all
    of them: the messaging conventions' batch shape)."""
    if not tracing.active():
        return _OFF
    return _Batch(events, consumer)


class _Batch(_Process):
    __slots__ = ()

    def __init__(self, events: Sequence[InboxEvent], consumer: str) -> None:
        from opentelemetry.trace import Link, SpanKind

        topics = {e.topic for e in events}
        attributes: dict[str, Any] = {
            tracing.SYSTEM: "kafka",
            tracing.OPERATION_TYPE: "process",
            tracing.OPERATION_NAME: "process",
            tracing.CONSUMER_GROUP: consumer,
            tracing.BATCH_COUNT: len(events),
        }
        name = "process"
        if len(topics) == 1:
            attributes[tracing.DESTINATION] = name_topic = next(iter(topics))
            name = f"process {name_topic}"
        links = []
        for event in events:
            headers = dict(carrier(event))  # the last of a repeated header wins
            parent = headers.get(tracing.TRACEPARENT)
            if parent is None:
                continue
            state = headers.get(tracing.TRACESTATE)
            context = tracing.span_context(
                parent.decode("latin-1"), None if state is None else state.decode("latin-1")
            )
            if context is not None:
                links.append(Link(context, {tracing.MESSAGE_ID: event.event_id}))
                if len(links) == MAX_LINKS:
                    attributes[LINKS_DROPPED] = len(events) - MAX_LINKS
                    break
        self._span = tracing.tracer().start_span(
            name, kind=SpanKind.CONSUMER, attributes=attributes, links=links
        )


def duplicate(event: InboxEvent, consumer: str) -> None:
    """A redelivered event the inbox skipped (its handler committed before)."""
    if not tracing.active():
        return
    _start(event, consumer, {tracing.DUPLICATE: True}).end()


def dead_lettered(
    event: InboxEvent, consumer: str, failure: Failure, attempts: int, dlq_topic: str
) -> None:
    """The event went to the dead-letter topic after ``attempts`` runs."""
    if not tracing.active():
        return
    from opentelemetry.trace import Status, StatusCode

    span = _start(
        event,
        consumer,
        {
            tracing.ATTEMPT: attempts,
            tracing.DEAD_LETTER: True,
            tracing.DEAD_LETTER_REASON: failure.message[:200],
            tracing.DEAD_LETTER_TOPIC: dlq_topic,
            tracing.ERROR_TYPE: failure.error_class,
        },
    )
    span.add_event(
        "dead_lettered",
        {"outbox.error_class": failure.error_class, "outbox.retryable": failure.retryable},
    )
    span.set_status(Status(StatusCode.ERROR, f"dead-lettered: {failure.error_class}"))
    span.end()

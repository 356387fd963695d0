"""OpenTelemetry traces, when the ``otel`` extra (``opentelemetry-api``) is installed.

The framework only uses the API: the application decides whether anything is recorded by
configuring an SDK ``TracerProvider`` (and its exporters). Three situations:

* the API is not installed: nothing here imports it, every hook is a constant no-op;
* the API is installed but no provider is configured (tracing off): the hooks check
  :func:`active` (a global lookup and an ``isinstance``) and return before doing any work,
  so the hot paths pay one function call per batch or event (a provider set later is
  noticed within a second);
* a provider is configured: ``publish`` writes the current W3C trace context
  (``traceparent``/``tracestate``) into the row's headers unless the caller set one, the
  relay links its send span to each message's context, and the consumer's process span is
  a child of it — one trace from the request that published the event to its handler.

The context travels as ordinary event headers, which the relay copies to the Kafka
record, so it also reaches consumers that are not written with this framework (the
CloudEvents distributed-tracing extension uses the same two headers).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox.envelope import Message

try:  # the optional extra: without it this module is inert and imports nothing
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised by the import-blocking test
    _trace = None  # type: ignore[assignment]
    TraceContextTextMapPropagator = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanContext, Tracer

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
INSTRUMENTATION = "outbox-inbox"

# Attribute names. The messaging ones follow the OpenTelemetry semantic conventions; the
# framework's own outcomes (attempts, duplicates, dead letters) are under ``outbox.``.
SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
PARTITION = "messaging.destination.partition.id"
MESSAGE_ID = "messaging.message.id"
KAFKA_KEY = "messaging.kafka.message.key"
KAFKA_OFFSET = "messaging.kafka.offset"
CONSUMER_GROUP = "messaging.consumer.group.name"
BATCH_COUNT = "messaging.batch.message_count"
ERROR_TYPE = "error.type"
ATTEMPT = "outbox.attempt"
DUPLICATE = "outbox.duplicate"
DEAD_LETTER = "outbox.dead_letter"
DEAD_LETTER_REASON = "outbox.dead_letter.reason"
DEAD_LETTER_TOPIC = "outbox.dead_letter.topic"
IDEMPOTENCY_KEY = "outbox.idempotency.key"
EFFECT_KEY = "outbox.effect.key"
EFFECT_DEPENDENCY = "outbox.effect.dependency"
EFFECT_REPLAYED = "outbox.effect.replayed"
EFFECT_RECONCILED = "outbox.effect.reconciled"

_propagator = TraceContextTextMapPropagator() if _trace is not None else None
_tracer: tuple[Any, Tracer] | None = None
_active = False
_checked_at = -math.inf
_RECHECK_SECONDS = 1.0


def active() -> bool:
    """True when the API is installed and the application configured a tracer provider.

    The API's default provider is a proxy that hands out no-op tracers until an SDK
    provider is set. Asking the API costs about a microsecond (it looks up an environment
    variable each time), too much per event, so the answer is cached: "yes" for good (a
    provider, once set, cannot be replaced), "no" for up to a second — a provider set
    after the process started publishing or consuming takes effect within that second.
    """
    global _active, _checked_at
    if _active or _trace is None:
        return _active
    now = time.monotonic()
    if now - _checked_at < _RECHECK_SECONDS:
        return False
    _checked_at = now
    provider = _trace.get_tracer_provider()
    _active = not isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider)
    return _active


def tracer() -> Tracer:
    """The framework's tracer from the current global provider (cached per provider)."""
    global _tracer
    assert _trace is not None
    provider = _trace.get_tracer_provider()
    if _tracer is None or _tracer[0] is not provider:
        _tracer = (provider, provider.get_tracer(INSTRUMENTATION))
    return _tracer[1]


def current_context_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when there is none."""
    if _propagator is None or not active():
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def with_trace_context(messages: Iterable[Message]) -> Iterable[Message]:
    """``messages`` with the current trace context added to the headers of those that do
    not carry a ``traceparent`` of their own (an explicit one wins: the caller may be
    forwarding another request's context)."""
    if not active():
        return messages
    carrier = current_context_headers()
    if not carrier:
        return messages
    # What is not a Message with a mapping of headers is left for the checks to refuse.
    return [
        dataclasses.replace(m, headers={**m.headers, **carrier})
        if isinstance(m, Message)
        and isinstance(m.headers, Mapping)
        and TRACEPARENT not in m.headers
        else m
        for m in messages
    ]


def span_context(traceparent: object, tracestate: str | None = None) -> SpanContext | None:
    """The remote span context of a W3C ``traceparent`` (version 00), or None if invalid.

    Parsed here rather than through the propagator: the relay does this for rows of
    every batch and the consumer for every event, and the propagator's generic path (a
    carrier, a getter, a regex, a Context) costs several times more.
    """
    if _trace is None or not isinstance(traceparent, str) or len(traceparent) != 55:
        return None
    parts = traceparent.split("-")
    if len(parts) != 4 or parts[0] != "00":
        return None
    try:
        context = _trace.SpanContext(
            int(parts[1], 16),
            int(parts[2], 16),
            is_remote=True,
            trace_flags=_trace.TraceFlags(int(parts[3], 16) & _trace.TraceFlags.SAMPLED),
            trace_state=_trace.TraceState.from_header([tracestate]) if tracestate else None,
        )
    except ValueError:
        return None
    return context if context.is_valid else None


def extract_record(headers: Sequence[tuple[str, bytes]]) -> Context | None:
    """The remote context carried by Kafka record headers (``(name, bytes)`` pairs)."""
    parent = state = None
    for name, value in headers:
        if name == TRACEPARENT:
            parent = value.decode("latin-1")
        elif name == TRACESTATE:
            state = value.decode("latin-1")
    context = span_context(parent, state)
    if context is None:
        return None
    assert _trace is not None
    return _trace.set_span_in_context(_trace.NonRecordingSpan(context))


def set_current_attributes(attributes: Mapping[str, Any]) -> None:
    """Add attributes to the current span (e.g. the request's server span), if recording."""
    if not active():
        return
    assert _trace is not None
    span = _trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)

"""Envelopes: how a consumer reads the records of producers it did not write.

An envelope turns a Kafka record into what the inbox needs: the producer's event id (the
dedupe key), the event type or none, the payload bytes, their content type and other
metadata. A consumer has one (``Consumer(envelope=...)``, default ``"cloudevents"``) and
may override it per topic (``Consumer(envelopes={"orders": "debezium"})``)::

    inbox.Consumer(name="billing", topics=["orders"])                      # CloudEvents
    inbox.Consumer(name="billing", topics=["outbox.event.order"], envelope="debezium")
    inbox.Consumer(name="billing", topics=["payments"],
                   envelope=Generic(id=Pointer("/meta/id"), type=Pointer("/meta/type")))
    inbox.Consumer(name="billing", topics=["clicks"], envelope="position")
    inbox.Consumer(name="billing", topics=["legacy"], envelope="billing.wire:LegacyEnvelope")

Built in: :class:`CloudEvents` (binary and structured mode, per record), :class:`Debezium`
(the outbox event router), :class:`Generic` (named headers or JSON pointers; ``"position"``
is ``Generic(id=Position())``). Your own: anything with ``open(record) -> Opened`` (or a
function ``record -> Opened``), given as an object or as ``"MODULE:ATTR"``.

A record its envelope cannot read is *malformed*: it is dead-lettered (or skipped, per
``malformed_policy``) with the envelope's reason, under the id ``topic:partition:offset``.
"""

from __future__ import annotations

from collections.abc import Callable

from inbox.envelopes.base import BuiltIn, Custom, Envelope, FromFunction, Opened, Reader
from inbox.envelopes.cloudevents import CloudEvents
from inbox.envelopes.debezium import Debezium
from inbox.envelopes.generic import Generic, Header, Pointer, Position
from inbox.errors import EnvelopeError, Unreadable
from outbox.imports import import_target

EnvelopeSpec = Envelope | Callable[..., Opened] | str

BUILT_IN: dict[str, Callable[[], BuiltIn]] = {
    "cloudevents": CloudEvents,
    "debezium": Debezium,
    "position": lambda: Generic(id=Position()),
}


def resolve(spec: EnvelopeSpec) -> Reader:
    """The envelope ``spec`` names: a built-in's name, ``"MODULE:ATTR"``, or an object
    (an envelope instance or class, or a function ``record -> Opened``)."""
    name = getattr(spec, "__qualname__", type(spec).__qualname__)
    target: object = spec
    if isinstance(spec, str):
        if spec in BUILT_IN:
            return BUILT_IN[spec]()
        if ":" not in spec:
            known = ", ".join(BUILT_IN)
            raise EnvelopeError(
                f"unknown envelope {spec!r}: give {known}, an inbox.envelopes object, or "
                "MODULE:ATTR of your own"
            )
        try:
            target = import_target(spec)
        except ValueError as exc:
            raise EnvelopeError(f"envelope {spec!r}: {exc}") from None
        name = spec
    if isinstance(target, type):
        try:
            target = target()
        except Exception as exc:
            raise EnvelopeError(
                f"envelope {name}: cannot make one without arguments ({type(exc).__name__}: "
                f"{exc}); give an instance"
            ) from None
    if isinstance(target, BuiltIn):
        return target
    if callable(getattr(target, "open", None)):
        return Custom(target, name)  # type: ignore[arg-type]
    if callable(target):
        return Custom(FromFunction(target), name)
    raise EnvelopeError(
        f"{name} is not an envelope: give an object with open(record) -> Opened, or a "
        "function record -> Opened"
    )


__all__ = [
    "CloudEvents",
    "Debezium",
    "Envelope",
    "EnvelopeError",
    "EnvelopeSpec",
    "Generic",
    "Header",
    "Opened",
    "Pointer",
    "Position",
    "Reader",
    "Unreadable",
    "resolve",
]

"""The consumer application object: a name, topics and a registry of handlers.

::

    app = inbox.Consumer(name="billing", topics=["orders"])

    @app.handler("order.created")
    async def charge(event: OrderCreated, session: AsyncSession) -> None:
        session.add(Charge(order_id=event.order_id))   # same transaction as the inbox row

Events without a type (a Debezium outbox topic, a plain JSON topic: see
:mod:`inbox.envelopes`) are routed by topic::

    app = inbox.Consumer(name="billing", topics=["outbox.event.order"], envelope="debezium")

    @app.handler(topic="outbox.event.order")     # every record of the topic
    async def on_order(event: OrderEvent, session: AsyncSession) -> None: ...

``@app.handler("t", topic="x")`` takes type ``t`` on topic ``x`` only. Two handlers that
could both claim one record are refused when the second is declared.

A handler's first parameter decides what it receives: annotated with a pydantic model,
the payload parsed into it (a validation error is permanent: dead-lettered at once);
otherwise the raw :class:`~inbox.event.InboxEvent`. A tombstone (a record with a null value,
``outbox.TOMBSTONE`` on the producer side) reaches a model-typed handler only when the
annotation admits it, ``Model | None`` (the handler gets ``None``); a handler typed with the
model alone cannot take it, which is a permanent error (:class:`TombstoneRefused`). A third
parameter annotated :class:`~inbox.context.EventContext` receives the event's metadata (id,
key, headers, partition, offset, attempt). ``async def`` handlers get an ``AsyncSession``;
plain ``def`` handlers get a sync ``Session`` on the same connection and transaction (run
through ``AsyncSession.run_sync``).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from inbox.context import EventContext
from inbox.envelopes import EnvelopeSpec, Reader, resolve
from inbox.errors import HandlerConfigurationError, TombstoneRefused
from inbox.event import InboxEvent, KafkaRecord
from outbox import identifiers
from outbox.settings import OutboxSettings

HandlerFn = Callable[..., Any]
Decoder = Callable[[KafkaRecord], InboxEvent]


@dataclass(frozen=True)
class Handler:
    # None: every record of ``topic`` (typed or not) that no typed handler there takes.
    event_type: str | None
    fn: HandlerFn
    model: type[BaseModel] | None
    is_async: bool
    max_attempts: int | None
    # "skip": events carrying a sequence (``publish(..., sequence=N)``) not above the
    # highest one applied for their key are skipped instead of handled.
    stale: Literal["skip"] | None = None
    # The handler declared a third parameter typed EventContext.
    wants_context: bool = False
    # The model parameter is annotated ``Model | None``: a tombstone arrives as None.
    takes_tombstones: bool = False
    # None: the event type on every topic of the consumer.
    topic: str | None = None

    @property
    def claim(self) -> str:
        """Which records it takes, in words."""
        if self.event_type is None:
            return f"every record of topic {self.topic!r}"
        where = "" if self.topic is None else f" on topic {self.topic!r}"
        return f"event type {self.event_type!r}{where}"

    def describe(self) -> str:
        return f"{self.fn.__qualname__} ({self.claim})"

    def parse(self, event: InboxEvent) -> Any:
        if self.model is None:
            return event
        if event.value is None:
            if self.takes_tombstones:
                return None
            raise TombstoneRefused(
                f"event {event.event_id} is a tombstone (null value) and handler "
                f"{self.fn.__qualname__} takes {self.model.__name__}; annotate it "
                f"{self.model.__name__} | None, or take the InboxEvent, to handle deletions"
            )
        return self.model.model_validate_json(event.value)

    async def __call__(self, event: InboxEvent, session: AsyncSession, attempt: int = 1) -> None:
        arg = self.parse(event)
        extra = (EventContext.of(event, attempt),) if self.wants_context else ()
        if self.is_async:
            await typing.cast(Awaitable[None], self.fn(arg, session, *extra))
        else:
            await session.run_sync(lambda sync_session: self.fn(arg, sync_session, *extra))


def _model_of(hint: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model of a first parameter annotated ``Model`` or ``Model | None`` (then it
    takes tombstones too); (None, False) for anything else."""
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint, False
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else ()
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    if len(models) == 1 and len(members) == 2 and type(None) in members:
        return models[0], True
    return None, False


def _signature_of(fn: HandlerFn) -> tuple[type[BaseModel] | None, bool, bool]:
    """The handler's payload model (None: it takes the raw event), whether the model
    parameter admits None (tombstones) and whether it takes an :class:`EventContext`
    third."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        raise HandlerConfigurationError(f"handler {fn.__qualname__} must accept (event, session)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an unresolvable annotation is a declaration bug
        raise HandlerConfigurationError(
            f"cannot resolve annotations of handler {fn.__qualname__}: {exc}"
        ) from None
    model, takes_tombstones = _model_of(hints.get(params[0].name))
    wants_context = len(params) > 2 and hints.get(params[2].name) is EventContext
    extra = params[3:] if wants_context else params[2:]
    if any(p.default is inspect.Parameter.empty for p in extra):
        raise HandlerConfigurationError(
            f"handler {fn.__qualname__} takes (event, session) and optionally a third "
            "parameter annotated EventContext; any others need defaults"
        )
    return model, takes_tombstones, wants_context


@dataclass
class Consumer:
    """A named consumer: its Kafka group id and inbox identity are ``name``.

    ``kafka_options`` are passed to ``AIOKafkaConsumer``; auto-commit is refused because
    offsets must only move after the database commit.

    ``envelope`` says how records are read (:mod:`inbox.envelopes`): ``"cloudevents"``
    (default; binary and structured mode), ``"debezium"``, ``"position"``, an envelope
    object, or ``"MODULE:ATTR"`` of your own; ``envelopes`` overrides it per topic. It is
    declared here, in code, not in settings: the handlers are written for what it yields
    (typed events or not), so changing one without the other would misroute events.
    """

    name: str
    topics: Sequence[str]
    settings: OutboxSettings | None = None
    kafka_options: Mapping[str, Any] = field(default_factory=dict)
    envelope: EnvelopeSpec = "cloudevents"
    envelopes: Mapping[str, EnvelopeSpec] = field(default_factory=dict)
    # Handlers of an event type on every topic, by type.
    handlers: dict[str, Handler] = field(default_factory=dict, init=False)
    # Handlers of one topic, by (topic, type); type None: every record of the topic.
    topic_handlers: dict[tuple[str, str | None], Handler] = field(default_factory=dict, init=False)
    _readers: dict[str, Reader] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        identifiers.kafka_name(self.name, "consumer name")
        if not self.topics:
            raise HandlerConfigurationError("a consumer needs at least one topic")
        self.topics = tuple(identifiers.kafka_name(t, "topic") for t in self.topics)
        if self.kafka_options.get("enable_auto_commit"):
            raise HandlerConfigurationError(
                "enable_auto_commit is refused: offsets are committed only after the "
                "database transaction of the handler committed"
            )
        for forbidden in ("group_id", "enable_auto_commit"):
            if forbidden in self.kafka_options:
                raise HandlerConfigurationError(
                    f"kafka option {forbidden!r} is set by the consumer itself"
                )
        strays = sorted(set(self.envelopes) - set(self.topics))
        if strays:
            raise HandlerConfigurationError(
                f"envelopes given for topics the consumer does not read: {', '.join(strays)}"
            )
        default = resolve(self.envelope)
        self._readers = {
            topic: resolve(self.envelopes[topic]) if topic in self.envelopes else default
            for topic in self.topics
        }

    def handler(
        self,
        event_type: str | None = None,
        *,
        topic: str | None = None,
        max_attempts: int | None = None,
        stale: Literal["skip"] | None = None,
    ) -> Callable[[HandlerFn], HandlerFn]:
        """Register the decorated function for events of type ``event_type`` (on every
        topic, or on ``topic`` only), or for every record of ``topic`` (no type: what
        envelopes without types yield, e.g. Debezium's by default).

        ``stale="skip"`` guards the handler against out-of-date events: an event whose
        ``sequence`` is not above the highest sequence this consumer applied for its key is
        skipped (counted as stale), so a dead letter replayed late or a retried failed row
        cannot overwrite newer state. Events without a sequence are handled as usual.
        """
        if max_attempts is not None and max_attempts < 1:
            raise HandlerConfigurationError("max_attempts must be at least 1")
        if stale not in (None, "skip"):
            raise HandlerConfigurationError(f"stale must be 'skip' or None, not {stale!r}")
        if event_type is None and topic is None:
            raise HandlerConfigurationError("a handler needs an event type, a topic, or both")
        if event_type is not None and (not isinstance(event_type, str) or not event_type):
            raise HandlerConfigurationError(
                f"event type must be a non-empty string: {event_type!r}"
            )
        if topic is not None and topic not in self.topics:
            raise HandlerConfigurationError(
                f"topic {topic!r} is not one of this consumer's: {', '.join(self.topics)}"
            )

        def register(fn: HandlerFn) -> HandlerFn:
            model, takes_tombstones, wants_context = _signature_of(fn)
            new = Handler(
                event_type=event_type,
                fn=fn,
                model=model,
                wants_context=wants_context,
                takes_tombstones=takes_tombstones,
                is_async=inspect.iscoroutinefunction(fn),
                max_attempts=max_attempts,
                stale=stale,
                topic=topic,
            )
            self._check(new)
            if topic is None:
                assert event_type is not None
                self.handlers[event_type] = new
            else:
                self.topic_handlers[(topic, event_type)] = new
            return fn

        return register

    def envelope_for(self, topic: str) -> Reader:
        """How this consumer reads the records of ``topic``."""
        reader = self._readers.get(topic)
        if reader is None:
            raise HandlerConfigurationError(
                f"topic {topic!r} is not one of this consumer's: {', '.join(self.topics)}"
            )
        return reader

    def decoder(self, topic: str) -> Decoder:
        """Record -> InboxEvent for ``topic`` (resolved once per partition, not per record)."""
        return self.envelope_for(topic).decode

    def router(self, topic: str) -> Callable[[str | None], Handler | None]:
        """Event type -> its handler on ``topic`` (None: unknown), for a partition's
        processor: one dict lookup per event."""
        table: dict[str | None, Handler] = {etype: h for etype, h in self.handlers.items()}
        table.update(
            (etype, h) for (t, etype), h in self.topic_handlers.items() if t == topic and etype
        )
        fallback = self.topic_handlers.get((topic, None))
        if fallback is None:
            return table.get
        return lambda event_type: table.get(event_type, fallback)

    def _check(self, new: Handler) -> None:
        """Refuse a handler that shares a record with one declared before, or never runs."""
        for old in (*self.handlers.values(), *self.topic_handlers.values()):
            topics = self._shared_topics(old.topic, new.topic)
            if not topics:
                continue
            if old.event_type is not None and new.event_type is not None:
                clash = old.event_type == new.event_type
            elif old.event_type is None and new.event_type is None:
                clash = True
            else:  # a typed handler and one for every record: typed records on a shared topic
                clash = any(self._readers[t].typed is not False for t in topics)
            if clash and (old.event_type, old.topic) == (new.event_type, new.topic):
                raise HandlerConfigurationError(
                    f"{new.claim} already has handler {old.fn.__qualname__}"
                )
            if clash:
                raise HandlerConfigurationError(
                    f"handlers {old.describe()} and {new.describe()} could both claim a "
                    f"record of topic {topics[0]!r}: give each its own type or topic"
                )
        if new.event_type is not None:
            scope = [new.topic] if new.topic is not None else list(self.topics)
            if all(self._readers[t].typed is False for t in scope):
                raise HandlerConfigurationError(
                    f"handler {new.describe()} would never run: the envelope of "
                    f"{', '.join(scope)} yields no event types; use @app.handler(topic=...)"
                )

    def _shared_topics(self, a: str | None, b: str | None) -> list[str]:
        if a is not None and b is not None:
            return [a] if a == b else []
        if a is not None or b is not None:
            return [a or b or ""]
        return list(self.topics)

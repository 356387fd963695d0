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

A *batch handler* (``batch=True``) takes a list first and is called once for a run of
consecutive events of its type in one transaction, for set-based work::

    @app.handler("order.created", batch=True, max_batch=1000)
    async def project(orders: list[OrderCreated], session: AsyncSession) -> None:
        await session.execute(insert(OrderRow), [o.model_dump() for o in orders])

The list is in offset order per partition and holds only new events (duplicates are
claimed away before the call); a third parameter ``list[EventContext]`` gets each one's
metadata, index for index. When the call raises, nothing of it commits and the list is
split until the failing event is found; it alone is retried or dead-lettered. Raise
``Permanent(..., event=item)`` to name the item at fault: it alone is dead-lettered, the
others handled again without it.
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
    # A batch handler: called with a list of events (and a list of contexts).
    batch: bool = False
    # Most events in one call of a batch handler (None: the settings' handler_max_batch).
    max_batch: int | None = None

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
        if self.batch:
            contexts = [EventContext.of(event, attempt)] if self.wants_context else None
            await self.call_batch([event], [self.parse(event)], session, contexts)
            return
        arg = self.parse(event)
        extra = (EventContext.of(event, attempt),) if self.wants_context else ()
        await self._invoke(session, arg, *extra)

    async def call_batch(
        self,
        events: Sequence[InboxEvent],
        args: list[Any],
        session: AsyncSession,
        contexts: list[EventContext] | None,
    ) -> None:
        """Call a batch handler with ``args`` (``events`` parsed, see :meth:`parse`) and,
        when it declared them, ``contexts`` (built from ``events`` when None)."""
        if not self.wants_context:
            await self._invoke(session, args)
            return
        if contexts is None:
            contexts = [EventContext.of(e, 1) for e in events]
        await self._invoke(session, args, contexts)

    async def _invoke(self, session: AsyncSession, first: Any, *extra: Any) -> None:
        if self.is_async:
            await typing.cast(Awaitable[None], self.fn(first, session, *extra))
        else:
            await session.run_sync(lambda sync_session: self.fn(first, sync_session, *extra))

    def batch_limit(self, default: int) -> int:
        """Most events in one call (1 for a per-event handler)."""
        if not self.batch:
            return 1
        return default if self.max_batch is None else self.max_batch


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


# What a batch handler's first parameter may be annotated with: list[X] or Sequence[X].
_LISTS = (list, Sequence, typing.Sequence)


def _list_item(hint: Any) -> Any:
    """X of a ``list[X]`` (or ``Sequence[X]``) annotation; ``_NOT_A_LIST`` otherwise."""
    if typing.get_origin(hint) in _LISTS:
        args = typing.get_args(hint)
        return args[0] if len(args) == 1 else Any
    return _NOT_A_LIST


_NOT_A_LIST = object()


def _signature_of(fn: HandlerFn, batch: bool) -> tuple[type[BaseModel] | None, bool, bool]:
    """The handler's payload model (None: it takes the raw event), whether the model
    parameter admits None (tombstones) and whether it takes an :class:`EventContext`
    third (a ``list[EventContext]`` for a batch handler)."""
    name = fn.__qualname__
    params = list(inspect.signature(fn).parameters.values())
    shape = "(events, session)" if batch else "(event, session)"
    if len(params) < 2:
        raise HandlerConfigurationError(f"handler {name} must accept {shape}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an unresolvable annotation is a declaration bug
        raise HandlerConfigurationError(
            f"cannot resolve annotations of handler {name}: {exc}"
        ) from None
    first = hints.get(params[0].name)
    item = _list_item(first)
    if batch and item is _NOT_A_LIST:
        raise HandlerConfigurationError(
            f"batch handler {name} must take a list first: annotate {params[0].name!r} "
            "list[Model] (a pydantic model) or list[InboxEvent]"
        )
    if not batch and item is not _NOT_A_LIST:
        raise HandlerConfigurationError(
            f"handler {name} takes a list first: declare it with batch=True to receive "
            "events in lists, or annotate one event"
        )
    if batch:
        first = item
        if not _is_model_or_event(first):
            raise HandlerConfigurationError(
                f"batch handler {name}: the list's items must be a pydantic model or "
                f"InboxEvent, not {first!r}"
            )
    model, takes_tombstones = _model_of(first)
    context = hints.get(params[2].name) if len(params) > 2 else None
    wants_context = (_list_item(context) if batch else context) is EventContext
    if batch and context is EventContext:
        raise HandlerConfigurationError(
            f"batch handler {name}: annotate {params[2].name!r} list[EventContext] "
            "(one context per event of the list)"
        )
    extra = params[3:] if wants_context else params[2:]
    if any(p.default is inspect.Parameter.empty for p in extra):
        raise HandlerConfigurationError(
            f"handler {name} takes {shape} and optionally a third parameter annotated "
            f"{'list[EventContext]' if batch else 'EventContext'}; any others need defaults"
        )
    return model, takes_tombstones, wants_context


def _is_model_or_event(hint: Any) -> bool:
    if hint is Any or (isinstance(hint, type) and issubclass(hint, InboxEvent)):
        return True
    return _model_of(hint)[0] is not None


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
        batch: bool = False,
        max_batch: int | None = None,
    ) -> Callable[[HandlerFn], HandlerFn]:
        """Register the decorated function for events of type ``event_type`` (on every
        topic, or on ``topic`` only), or for every record of ``topic`` (no type: what
        envelopes without types yield, e.g. Debezium's by default).

        ``stale="skip"`` guards the handler against out-of-date events: an event whose
        ``sequence`` is not above the highest sequence this consumer applied for its key is
        skipped (counted as stale), so a dead letter replayed late or a retried failed row
        cannot overwrite newer state. Events without a sequence are handled as usual.

        ``batch=True`` makes it a batch handler (see the module docstring): its first
        parameter is ``list[Model]`` or ``list[InboxEvent]``, and it gets up to
        ``max_batch`` events per call (default: ``OUTBOX_CONSUMER__HANDLER_MAX_BATCH``).
        Attempts, dead letters and ``stale`` still apply to each event on its own::

            @app.handler("order.placed", batch=True, max_batch=1000)
            async def project(orders: list[OrderPlaced], session: AsyncSession) -> None:
                for order in orders:
                    if order.total_cents < 0:
                        raise Permanent("negative total", event=order)  # only this one
                await session.execute(upsert, [o.model_dump() for o in orders])

        A declaration that does not fit (no list first with ``batch=True``, a list without
        it, ``max_batch`` below 1 or without ``batch=True``) raises
        :class:`~inbox.errors.HandlerConfigurationError` here, when the module is imported.
        """
        if max_batch is not None:
            if not batch:
                raise HandlerConfigurationError("max_batch is for batch handlers (batch=True)")
            if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
                raise HandlerConfigurationError(
                    f"max_batch must be a whole number of at least 1, not {max_batch!r}"
                )
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
            model, takes_tombstones, wants_context = _signature_of(fn, batch)
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
                batch=batch,
                max_batch=max_batch,
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

"""The consumer application object: a name, topics and a registry of handlers.

::

    app = inbox.Consumer(name="billing", topics=["orders"])

    @app.handler("order.created")
    async def charge(event: OrderCreated, session: AsyncSession) -> None:
        session.add(Charge(order_id=event.order_id))   # same transaction as the inbox row

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
from inbox.errors import HandlerConfigurationError, TombstoneRefused
from inbox.event import InboxEvent
from outbox import identifiers
from outbox.settings import OutboxSettings

HandlerFn = Callable[..., Any]


@dataclass(frozen=True)
class Handler:
    event_type: str
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
    """

    name: str
    topics: Sequence[str]
    settings: OutboxSettings | None = None
    kafka_options: Mapping[str, Any] = field(default_factory=dict)
    handlers: dict[str, Handler] = field(default_factory=dict, init=False)

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

    def handler(
        self,
        event_type: str,
        *,
        max_attempts: int | None = None,
        stale: Literal["skip"] | None = None,
    ) -> Callable[[HandlerFn], HandlerFn]:
        """Register the decorated function for CloudEvents type ``event_type``.

        ``stale="skip"`` guards the handler against out-of-date events: an event whose
        ``sequence`` is not above the highest sequence this consumer applied for its key is
        skipped (counted as stale), so a dead letter replayed late or a retried failed row
        cannot overwrite newer state. Events without a sequence are handled as usual.
        """
        if max_attempts is not None and max_attempts < 1:
            raise HandlerConfigurationError("max_attempts must be at least 1")
        if stale not in (None, "skip"):
            raise HandlerConfigurationError(f"stale must be 'skip' or None, not {stale!r}")

        def register(fn: HandlerFn) -> HandlerFn:
            if event_type in self.handlers:
                raise HandlerConfigurationError(
                    f"event type {event_type!r} already has handler "
                    f"{self.handlers[event_type].fn.__qualname__}"
                )
            model, takes_tombstones, wants_context = _signature_of(fn)
            self.handlers[event_type] = Handler(
                event_type=event_type,
                fn=fn,
                model=model,
                wants_context=wants_context,
                takes_tombstones=takes_tombstones,
                is_async=inspect.iscoroutinefunction(fn),
                max_attempts=max_attempts,
                stale=stale,
            )
            return fn

        return register

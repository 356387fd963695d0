"""The consumer application object: a name, topics and a registry of handlers.

::

    app = inbox.Consumer(name="billing", topics=["orders"])

    @app.handler("order.created")
    async def charge(event: OrderCreated, session: AsyncSession) -> None:
        session.add(Charge(order_id=event.order_id))   # same transaction as the inbox row

A handler's first parameter decides what it receives: annotated with a pydantic model,
the payload parsed into it (a validation error is permanent: dead-lettered at once);
otherwise the raw :class:`~inbox.event.InboxEvent`. ``async def`` handlers get an
``AsyncSession``; plain ``def`` handlers get a sync ``Session`` on the same connection
and transaction (run through ``AsyncSession.run_sync``).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from inbox.errors import HandlerConfigurationError
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

    def parse(self, event: InboxEvent) -> Any:
        if self.model is None:
            return event
        return self.model.model_validate_json(event.value or b"")

    async def __call__(self, event: InboxEvent, session: AsyncSession) -> None:
        arg = self.parse(event)
        if self.is_async:
            await typing.cast(Awaitable[None], self.fn(arg, session))
        else:
            await session.run_sync(lambda sync_session: self.fn(arg, sync_session))


def _model_of(fn: HandlerFn) -> type[BaseModel] | None:
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        raise HandlerConfigurationError(f"handler {fn.__qualname__} must accept (event, session)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an unresolvable annotation is a declaration bug
        raise HandlerConfigurationError(
            f"cannot resolve annotations of handler {fn.__qualname__}: {exc}"
        ) from None
    hint = hints.get(params[0].name)
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint
    return None


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
        self, event_type: str, *, max_attempts: int | None = None
    ) -> Callable[[HandlerFn], HandlerFn]:
        """Register the decorated function for CloudEvents type ``event_type``."""
        if max_attempts is not None and max_attempts < 1:
            raise HandlerConfigurationError("max_attempts must be at least 1")

        def register(fn: HandlerFn) -> HandlerFn:
            if event_type in self.handlers:
                raise HandlerConfigurationError(
                    f"event type {event_type!r} already has handler "
                    f"{self.handlers[event_type].fn.__qualname__}"
                )
            self.handlers[event_type] = Handler(
                event_type=event_type,
                fn=fn,
                model=_model_of(fn),
                is_async=inspect.iscoroutinefunction(fn),
                max_attempts=max_attempts,
            )
            return fn

        return register

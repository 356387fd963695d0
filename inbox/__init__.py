"""The inbox side of outbox-inbox: effectively-once event handlers on Kafka + PostgreSQL.

::

    import inbox

    app = inbox.Consumer(name="billing", topics=["orders"])

    @app.handler("order.created")
    async def charge(event: OrderCreated, session: AsyncSession) -> None:
        session.add(Charge(order_id=event.order_id))

A batch handler takes a list and does set-based work, one call per run of events::

    @app.handler("order.created", batch=True)
    async def project(orders: list[OrderCreated], session: AsyncSession) -> None:
        await session.execute(insert(OrderRow), [o.model_dump() for o in orders])

Run it with ``outbox consume mymodule:app``. Records of other producers (Debezium's outbox
router, structured-mode CloudEvents, plain JSON topics) are read by envelopes:
:mod:`inbox.envelopes`.
"""

from inbox.app import Consumer, Handler
from inbox.context import EventContext
from inbox.deadletters import DeadLetters, ReplayReport
from inbox.errors import (
    ConsumerAppNotFound,
    DeadLetterNotFound,
    EnvelopeError,
    HandlerConfigurationError,
    RecordTooLargeForTopic,
    ReplayRefused,
    TombstoneRefused,
    Unreadable,
)
from inbox.event import InboxEvent
from inbox.metrics import Metrics
from inbox.runner import ConsumerDaemon
from inbox.store import InboxStore
from outbox.ops.deadletters import DeadLetter, DeadLetterFilter, DeadLetterGroup
from outbox.resilience.classify import Permanent, Retryable

__all__ = [
    "Consumer",
    "ConsumerAppNotFound",
    "ConsumerDaemon",
    "DeadLetter",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterNotFound",
    "DeadLetters",
    "EnvelopeError",
    "EventContext",
    "Handler",
    "HandlerConfigurationError",
    "InboxEvent",
    "InboxStore",
    "Metrics",
    "Permanent",
    "RecordTooLargeForTopic",
    "ReplayRefused",
    "ReplayReport",
    "Retryable",
    "TombstoneRefused",
    "Unreadable",
]

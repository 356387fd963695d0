"""What a handler may ask for next to its payload: the event's metadata.

::

    @app.handler("order.created")
    async def charge(event: OrderCreated, session: AsyncSession, ctx: EventContext) -> None:
        log.info("charging", extra={"event_id": ctx.event_id, "attempt": ctx.attempt})

The third parameter is passed only when the handler declares it (annotated with
:class:`EventContext`), so handlers that do not need it cost nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from inbox.event import InboxEvent


@dataclass(frozen=True)
class EventContext(InboxEvent):
    """The consumed event (id, type, key, headers, topic, partition, offset, ...) and which
    attempt this run is: 1 on the first run, counted durably, so a retry after a crash
    sees the next number."""

    attempt: int = 1

    @classmethod
    def of(cls, event: InboxEvent, attempt: int) -> EventContext:
        return cls(**vars(event), attempt=attempt)

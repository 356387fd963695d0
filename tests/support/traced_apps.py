"""The consumer the trace test runs: `outbox consume tests.support.traced_apps:app`.

Payload {"fail_times": N}: a retryable error on the first N attempts (then success);
{"poison": true}: a permanent error (dead-lettered at once). An order.shipped event goes to a
*sync* handler that publishes a follow-up (shipment.noted, which this app does not handle):
the follow-up must continue the event's trace. order.batched events go to a *batch* handler
(one span per call, linked to each event's trace), which names a poison one in its
``Permanent``. Configured by INBOX_TEST_* environment
variables (the library never reads them) and the daemon's own OUTBOX_* settings.
"""

from __future__ import annotations

import os
from functools import cache

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import EventContext, Permanent, Retryable
from outbox import Outbox, OutboxSettings

app = inbox.Consumer(
    name=os.environ.get("INBOX_TEST_CONSUMER", "unconfigured"),
    topics=[os.environ.get("INBOX_TEST_TOPIC", "unconfigured")],
)


class Order(BaseModel):
    n: int
    fail_times: int = 0
    poison: bool = False


@app.handler("order.created", max_attempts=3)
async def handle(order: Order, session: AsyncSession, ctx: EventContext) -> None:
    if order.poison:
        raise Permanent("order cannot be handled")
    if ctx.attempt <= order.fail_times:
        raise Retryable(f"payment service busy (attempt {ctx.attempt})")


@cache
def _outbox() -> Outbox:
    return Outbox(OutboxSettings())


@app.handler("order.shipped")
def note_shipment(order: Order, session: Session) -> None:
    _outbox().publish(
        session, topic=app.topics[0], key="k", event_type="shipment.noted", payload={"n": order.n}
    )


@app.handler("order.batched", batch=True)
async def handle_many(orders: list[Order], session: AsyncSession) -> None:
    for order in orders:
        if order.poison:
            raise Permanent("order cannot be handled", event=order)

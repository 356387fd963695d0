"""The consumer the trace test runs: `outbox consume tests.support.traced_apps:app`.

Payload {"fail_times": N}: a retryable error on the first N attempts (then success);
{"poison": true}: a permanent error (dead-lettered at once). Configured by INBOX_TEST_*
environment variables (the library never reads them).
"""

from __future__ import annotations

import os

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox import EventContext, Permanent, Retryable

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

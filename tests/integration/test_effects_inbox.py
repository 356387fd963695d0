"""An inbox handler with an external effect: the key comes from the event (``key_for``), so
a retried run of the handler — its transaction rolled back after the call — replays the
refund from the ledger instead of making a second one."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import inbox
from examples.agent_tools.client import ProviderClient
from examples.agent_tools.provider import FakeProvider
from inbox import EventContext
from inbox.testing import InboxHarness
from outbox.effects import NOT_APPLIED, Effects, key_for
from outbox.resilience import Retryable, RetryPolicy
from outbox.settings import OutboxSettings

pytestmark = pytest.mark.integration


class RefundAsked(BaseModel):
    charge: str
    amount: int


async def test_a_retried_handler_replays_its_refund(
    settings: OutboxSettings, aengine: AsyncEngine
) -> None:
    effects = Effects(settings, policy=RetryPolicy(base_seconds=0.01), registry=CollectorRegistry())
    app = inbox.Consumer(name=f"refunds-{uuid.uuid4().hex[:8]}", topics=["refunds"])
    keys: list[str] = []
    results: list[Any] = []

    with FakeProvider() as provider:
        client = ProviderClient(provider.url)

        @app.handler("refund.asked", max_attempts=3)
        async def refund(asked: RefundAsked, session: AsyncSession, ctx: EventContext) -> None:
            key = key_for(ctx, "refund")
            keys.append(key)

            async def call(k: str) -> Any:
                return await asyncio.to_thread(client.refund, asked.charge, asked.amount, k)

            async def reconcile(k: str) -> Any:
                found = await asyncio.to_thread(client.find_refund, k)
                return NOT_APPLIED if found is None else found

            results.append(
                await effects.run_async(
                    aengine,
                    key=key,
                    payload=asked.model_dump(),
                    call=call,
                    reconcile=reconcile,
                    dependency="payments",
                )
            )
            if ctx.attempt == 1:
                raise Retryable("the handler's own transaction failed after the refund")

        async with InboxHarness(app, settings) as harness:
            delivery = await harness.deliver("refund.asked", RefundAsked(charge="ch_9", amount=90))
        assert (delivery.outcome, delivery.runs) == ("handled", 2)
        assert keys[0] == keys[1] == key_for(delivery.event, "refund")
        assert results[0] == results[1]
        assert provider.effects == 1

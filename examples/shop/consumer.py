"""The shipping consumer: applies order events exactly once, in per-order sequence.

Run it with ``outbox consume examples.shop.consumer:app``. Each handler writes its effect
in the session it is given, which is the transaction that also records the event in the
inbox, so a redelivered event finds its inbox row and is skipped instead of applied twice.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Identity, Integer, MetaData, Table, Text, func
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from examples.shop.events import TOPIC, OrderCreated, OrderEvent, OrderPaid, OrderShipped

CONSUMER_NAME = "shop-shipping"

metadata = MetaData()
# One row per applied effect; applied_id records the order in which effects happened,
# which the demo uses to count out-of-order pairs per order.
shipping_log = Table(
    "shop_shipping_log",
    metadata,
    Column("applied_id", BigInteger, Identity(), primary_key=True),
    Column("order_id", Text, nullable=False, index=True),
    Column("seq", Integer, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

app = inbox.Consumer(name=CONSUMER_NAME, topics=[TOPIC])


async def _apply(session: AsyncSession, event: OrderEvent, event_type: str) -> None:
    await session.execute(
        shipping_log.insert().values(order_id=event.order_id, seq=event.seq, event_type=event_type)
    )


@app.handler("order.created")
async def reserve_stock(event: OrderCreated, session: AsyncSession) -> None:
    await _apply(session, event, "order.created")


@app.handler("order.paid")
async def schedule_shipment(event: OrderPaid, session: AsyncSession) -> None:
    await _apply(session, event, "order.paid")


@app.handler("order.shipped")
async def notify_customer(event: OrderShipped, session: AsyncSession) -> None:
    await _apply(session, event, "order.shipped")

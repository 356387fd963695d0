"""The order service: each business action writes the order row and publishes its event
in the same transaction, so the event exists if and only if the order change committed."""

from __future__ import annotations

import random
import uuid

from sqlalchemy import Column, Integer, MetaData, Table, Text, update
from sqlalchemy.orm import Session

from examples.shop.events import TOPIC, OrderCreated, OrderPaid, OrderShipped
from outbox import Outbox, idempotency_key

metadata = MetaData()
orders = Table(
    "shop_orders",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("customer_id", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("total_cents", Integer, nullable=False),
)


class OrderService:
    def __init__(self, outbox: Outbox, order_prefix: str = "ord-") -> None:
        self.outbox = outbox
        self.order_prefix = order_prefix

    def place(self, session: Session, customer_id: str) -> str:
        order_id = f"{self.order_prefix}{uuid.uuid4().hex[:12]}"
        total = random.randint(500, 50_000)
        session.execute(
            orders.insert().values(
                order_id=order_id, customer_id=customer_id, status="created", total_cents=total
            )
        )
        event = OrderCreated(
            order_id=order_id,
            customer_id=customer_id,
            seq=1,
            total_cents=total,
            items=[{"sku": f"sku-{random.randint(1, 300)}", "qty": random.randint(1, 3)}],
        )
        self._publish(session, "order.created", event)
        return order_id

    def pay(self, session: Session, order_id: str, customer_id: str, amount: int) -> None:
        session.execute(update(orders).where(orders.c.order_id == order_id).values(status="paid"))
        event = OrderPaid(
            order_id=order_id,
            customer_id=customer_id,
            seq=2,
            payment_id=f"pay-{uuid.uuid4().hex[:10]}",
            amount_cents=amount,
        )
        self._publish(session, "order.paid", event)

    def ship(self, session: Session, order_id: str, customer_id: str) -> None:
        session.execute(
            update(orders).where(orders.c.order_id == order_id).values(status="shipped")
        )
        event = OrderShipped(
            order_id=order_id,
            customer_id=customer_id,
            seq=3,
            carrier="DHL",
            tracking_number=f"JD{random.randint(10**9, 10**10)}",
        )
        self._publish(session, "order.shipped", event)

    def _publish(
        self, session: Session, event_type: str, event: OrderCreated | OrderPaid | OrderShipped
    ) -> None:
        # The event id comes from the intent (order + step), so a retried request
        # publishes the same event id and every consumer sees a duplicate, not a new event.
        self.outbox.publish(
            session,
            topic=TOPIC,
            key=event.order_id,
            event_type=event_type,
            payload=event,
            event_id=idempotency_key("order", event.order_id, event_type),
            source="urn:example:shop:orders",
        )

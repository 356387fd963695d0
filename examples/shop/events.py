"""Event payloads of the shop, shared by the producer and the consumer."""

from __future__ import annotations

from pydantic import BaseModel, Field

TOPIC = "shop.orders"


class OrderEvent(BaseModel):
    order_id: str
    customer_id: str
    # Position of this event in the order's life (1 = created, 2 = paid, 3 = shipped).
    # The consumer checks it to prove per-key order end to end.
    seq: int = Field(ge=1)


class OrderCreated(OrderEvent):
    total_cents: int = Field(gt=0)
    currency: str = "EUR"
    items: list[dict[str, int | str]]


class OrderPaid(OrderEvent):
    payment_id: str
    amount_cents: int = Field(gt=0)


class OrderShipped(OrderEvent):
    carrier: str
    tracking_number: str

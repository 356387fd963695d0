"""The shipping consumer's handlers, through the real inbox path (no Kafka needed)."""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, select

from examples.shop.consumer import shipping_log
from examples.shop.events import OrderCreated, OrderPaid
from inbox.testing import InboxHarness


def _created(order_id: str) -> OrderCreated:
    return OrderCreated(
        order_id=order_id,
        customer_id="cus-1",
        seq=1,
        total_cents=1200,
        items=[{"sku": "sku-1", "qty": 2}],
    )


def _applied(engine: Engine, order_id: str) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(shipping_log.c.seq, shipping_log.c.event_type)
            .where(shipping_log.c.order_id == order_id)
            .order_by(shipping_log.c.applied_id)
        )
        return [(seq, event_type) for seq, event_type in rows]


def _order_id() -> str:
    return f"ord-{uuid.uuid4().hex[:8]}"


async def test_order_created_reserves_stock_once_even_when_delivered_twice(
    inbox_harness: InboxHarness, outbox_engine: Engine
) -> None:
    order_id = _order_id()
    first = await inbox_harness.deliver("order.created", _created(order_id), key=order_id)
    again = await inbox_harness.deliver(first.event)  # Kafka redelivers it
    assert (first.outcome, first.runs) == ("handled", 1)
    assert again.outcome == "duplicate"
    assert _applied(outbox_engine, order_id) == [(1, "order.created")]


async def test_each_step_of_an_order_is_applied_in_order(
    inbox_harness: InboxHarness, outbox_engine: Engine
) -> None:
    order_id = _order_id()
    await inbox_harness.deliver("order.created", _created(order_id), key=order_id)
    paid = OrderPaid(
        order_id=order_id, customer_id="cus-1", seq=2, payment_id="pay-1", amount_cents=1200
    )
    await inbox_harness.deliver("order.paid", paid, key=order_id)
    assert _applied(outbox_engine, order_id) == [(1, "order.created"), (2, "order.paid")]


async def test_an_invalid_order_is_dead_lettered_with_its_reason_and_not_applied(
    inbox_harness: InboxHarness, outbox_engine: Engine
) -> None:
    order_id = _order_id()
    bad = {"order_id": order_id, "customer_id": "cus-1", "seq": 1, "total_cents": -5}
    delivery = await inbox_harness.deliver("order.created", bad, key=order_id)
    assert delivery.outcome == "dead_lettered"
    assert delivery.dead_letter is not None
    assert delivery.dead_letter.topic == "shop.orders.dlq"
    assert delivery.dead_letter.error_class == "ValidationError"
    assert "total_cents" in delivery.dead_letter.error_message
    assert delivery.dead_letter.json() == bad  # the original record, for a replay
    assert _applied(outbox_engine, order_id) == []


async def test_an_event_type_without_handler_is_skipped(
    inbox_harness: InboxHarness,
) -> None:
    # Topics are shared by several event types: one this consumer does not handle is
    # skipped (OUTBOX_CONSUMER__UNKNOWN_TYPE_POLICY=dead_letter would dead-letter it).
    delivery = await inbox_harness.deliver("order.refunded", {"order_id": "o"}, key="o")
    assert delivery.outcome == "skipped"
    assert not inbox_harness.dead_letters


# Fixed ids, as tests often have: each test starts with a consumer that has seen nothing
# (the plugin's harness forgets the inbox after every test), so both are handled.
FIXED_EVENT_ID = "8c4e6c0e-0000-4000-8000-000000000001"


async def test_a_fixed_event_id_is_new_in_this_test(inbox_harness: InboxHarness) -> None:
    delivery = await inbox_harness.deliver(
        "order.created", _created("ord-fixed"), key="ord-fixed", event_id=FIXED_EVENT_ID
    )
    assert delivery.outcome == "handled"


async def test_the_same_fixed_event_id_is_new_in_this_test_too(
    inbox_harness: InboxHarness,
) -> None:
    delivery = await inbox_harness.deliver(
        "order.created", _created("ord-fixed"), key="ord-fixed", event_id=FIXED_EVENT_ID
    )
    assert delivery.outcome == "handled"

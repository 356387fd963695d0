"""The order service publishes through the outbox, in the caller's transaction; what it
published is then delivered to the shipping consumer (both halves tested, no Kafka)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from examples.shop.events import TOPIC, OrderCreated
from examples.shop.service import OrderService
from inbox.testing import InboxHarness
from outbox import Outbox, OutboxSettings
from outbox.testing import PublishedEvent

Published = Callable[..., list[PublishedEvent]]


@pytest.fixture
def orders(outbox_settings: OutboxSettings) -> OrderService:
    return OrderService(Outbox(outbox_settings))


def _of(events: list[PublishedEvent], order_id: str) -> list[PublishedEvent]:
    return [e for e in events if e.key == order_id]


def test_placing_an_order_publishes_order_created_keyed_by_the_order(
    orders: OrderService, outbox_engine: Engine, outbox_published: Published
) -> None:
    with Session(outbox_engine) as session, session.begin():
        order_id = orders.place(session, "cus-7")
        # Visible inside the unit of work, before anything commits.
        [event] = _of(outbox_published(session, topic=TOPIC), order_id)
    assert event.event_type == "order.created"
    created = OrderCreated.model_validate_json(event.payload)
    assert (created.order_id, created.customer_id, created.seq) == (order_id, "cus-7", 1)


def test_a_rolled_back_order_publishes_nothing(
    orders: OrderService, outbox_engine: Engine, outbox_published: Published
) -> None:
    class PaymentDeclined(Exception):
        pass

    with pytest.raises(PaymentDeclined), Session(outbox_engine) as session, session.begin():
        order_id = orders.place(session, "cus-8")
        raise PaymentDeclined
    with Session(outbox_engine) as session:
        assert _of(outbox_published(session, topic=TOPIC), order_id) == []


async def test_what_the_service_publishes_the_consumer_applies_once(
    orders: OrderService,
    outbox_engine: Engine,
    outbox_published: Published,
    inbox_harness: InboxHarness,
) -> None:
    with Session(outbox_engine) as session, session.begin():
        order_id = orders.place(session, "cus-9")
        orders.pay(session, order_id, "cus-9", amount=990)
    with Session(outbox_engine) as session:
        events = _of(outbox_published(session, topic=TOPIC), order_id)
    outcomes = [(await inbox_harness.deliver(e)).outcome for e in events]
    assert outcomes == ["handled", "handled"]
    assert (await inbox_harness.deliver(events[0])).outcome == "duplicate"

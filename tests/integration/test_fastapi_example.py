"""The FastAPI example over real HTTP (uvicorn on loopback) and real PostgreSQL: the
idempotency middleware and the route's session handed over by a FastAPI dependency."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select

from examples.fastapi_orders.app import TOPIC, create_app, orders
from outbox import build_tables
from outbox.settings import OutboxSettings
from tests.support.http import Server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(settings: OutboxSettings) -> Iterator[Server]:
    with Server(create_app(settings)) as running:
        yield running


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _post(client: httpx.Client, customer: str, key: str | None, body: Any) -> httpx.Response:
    headers = {"X-Customer-Id": customer}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/orders", json=body, headers=headers)


def _counts(engine: Engine, settings: OutboxSettings, customer: str) -> tuple[int, int]:
    """The customer's order rows and their order.placed outbox rows."""
    events = build_tables(settings).events
    with engine.connect() as conn:
        placed = conn.execute(
            select(func.count()).select_from(orders).where(orders.c.customer == customer)
        ).scalar_one()
        published = conn.execute(
            select(func.count())
            .select_from(events)
            .where(events.c.topic == TOPIC, events.c.payload.contains(customer.encode()))
        ).scalar_one()
    return placed, published


def test_created_then_replayed_then_conflict(
    client: httpx.Client, engine: Engine, settings: OutboxSettings
) -> None:
    customer, key = f"cus-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    body = {"total_cents": 990, "sku": "sku-1"}
    first = _post(client, customer, key, body)
    assert first.status_code == 201, first.text
    assert first.json()["customer"] == customer
    again = _post(client, customer, key, body)
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["idempotency-status"] == "replayed"
    assert _counts(engine, settings, customer) == (1, 1)

    other = _post(client, customer, key, {"total_cents": 991, "sku": "sku-1"})
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency.payload_mismatch"
    assert _counts(engine, settings, customer) == (1, 1)

    order = client.get(f"/orders/{first.json()['id']}")  # not an idempotent route
    assert order.status_code == 200 and order.json()["total_cents"] == 990


def test_missing_key_and_invalid_body_place_nothing(
    client: httpx.Client, engine: Engine, settings: OutboxSettings
) -> None:
    customer = f"cus-{uuid.uuid4().hex[:8]}"
    missing = _post(client, customer, None, {"total_cents": 1, "sku": "s"})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "idempotency.key_required"
    key = str(uuid.uuid4())
    invalid = _post(client, customer, key, {"total_cents": -1, "sku": "s"})
    assert invalid.status_code == 422  # FastAPI's validation error: final, so stored
    replay = _post(client, customer, key, {"total_cents": -1, "sku": "s"})
    assert replay.headers["idempotency-status"] == "replayed"
    assert replay.content == invalid.content
    assert _counts(engine, settings, customer) == (0, 0)

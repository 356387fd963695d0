"""An order API on FastAPI: ``POST /orders`` is idempotent and publishes ``order.placed``.

The idempotency middleware claims the ``Idempotency-Key``, and the route gets the session
whose transaction holds the key through an ordinary FastAPI dependency
(:data:`IdempotentSession`). The order row, its outbox event and the stored response
commit together — a retried request with the same key gets the stored 201 back
(``Idempotency-Status: replayed``) and places no second order.

    uvicorn --factory examples.fastapi_orders.app:main     # OUTBOX_* settings from the env

With the ``otel`` extra and an OpenTelemetry SDK configured (for example with
``opentelemetry-instrumentation-fastapi``), the request's span id travels with the event:
``publish`` writes it as the row's ``traceparent``, and the span gets the idempotency key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy import Column, DateTime, Integer, MetaData, Table, Text, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from outbox import Outbox, OutboxSettings, idempotency_key, load_settings, uuid7
from outbox.db import async_engine
from outbox.idempotency.asgi import IdempotencyMiddleware, idempotency_session

TOPIC = "fastapi.orders"

metadata = MetaData()
orders = Table(
    "fastapi_orders",
    metadata,
    Column("id", Text, primary_key=True),
    Column("customer", Text, nullable=False),
    Column("total_cents", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The route's session: its transaction holds the idempotency key; add rows and publish to
# it, never commit it (the middleware commits it with the stored response).
IdempotentSession = Annotated[AsyncSession, Depends(idempotency_session)]


class OrderIn(BaseModel):
    total_cents: int = Field(gt=0, le=100_000_000)
    sku: str = Field(min_length=1, max_length=64)


class OrderOut(BaseModel):
    id: str
    customer: str
    total_cents: int


def _customer(request: Request) -> str | None:
    # A stand-in for real authentication: keys are scoped per customer and route.
    return request.headers.get("x-customer-id") or None


def create_app(settings: OutboxSettings, engine: AsyncEngine | None = None) -> FastAPI:
    """The app. Run the framework's migrations first (``outbox db upgrade``)."""
    db = engine or async_engine(settings)
    outbox = Outbox(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with db.begin() as conn:
            await conn.run_sync(metadata.create_all)
        yield
        if engine is None:
            await db.dispose()

    app = FastAPI(title="orders", lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        engine=db,
        settings=settings,
        routes=[("POST", "/orders")],
        principal=_customer,
    )

    @app.post("/orders", status_code=201)
    async def place_order(body: OrderIn, request: Request, session: IdempotentSession) -> OrderOut:
        order = OrderOut(
            id=f"ord_{uuid7().hex}", customer=_customer(request) or "", total_cents=body.total_cents
        )
        await session.execute(orders.insert().values(**order.model_dump()))
        await outbox.publish_async(
            session,
            topic=TOPIC,
            key=order.id,
            event_type="order.placed",
            event_id=idempotency_key("order.placed", order.id),
            payload={**order.model_dump(), "sku": body.sku},
        )
        return order

    @app.get("/orders/{order_id}")
    async def get_order(order_id: str) -> dict[str, Any]:
        async with AsyncSession(db) as session:
            row = (await session.execute(select(orders).where(orders.c.id == order_id))).first()
        if row is None:
            raise HTTPException(404, "no such order")
        return dict(row._mapping) | {"created_at": row.created_at.isoformat()}

    return app


def main() -> FastAPI:
    return create_app(load_settings())

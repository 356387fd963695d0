"""A small payments service: idempotent POST /charges and POST /refunds.

Each refund request does three writes — the refund row, the charge's refunded total and a
``refund.created`` outbox event — and the idempotency middleware adds a fourth, the stored
response. All four commit in one transaction, or none does:

* same ``Idempotency-Key`` + same body  -> the stored 201, byte for byte,
  ``Idempotency-Status: replayed``; no second refund, no second event;
* same key + another body                -> 422 ``idempotency.payload_mismatch``;
* same key while the first is running    -> 409 ``idempotency.in_progress`` + Retry-After;
* refund larger than what is left        -> 422 ``refund.amount_exceeds_charge``, stored
  and replayed (a final failure);
* a transient failure (the ``fault`` hook raising, a dropped DB connection) -> 503, nothing
  committed, the key released so the client's retry runs again.

The principal is the ``X-Tenant-Id`` header — a stand-in for real authentication; keys are
scoped per tenant and route. ``client_sent_at`` is a volatile body field left out of the
request hash, so a client that re-stamps its retries is not told "payload mismatch".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import Column, DateTime, Integer, MetaData, Table, Text, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outbox import Outbox, OutboxSettings, idempotency_key, uuid7
from outbox.db import async_engine
from outbox.idempotency.asgi import IdempotencyMiddleware, idempotency_session

TOPIC = "payments.refunds"

metadata = MetaData()
charges = Table(
    "payments_charges",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("amount", Integer, nullable=False),
    Column("refunded", Integer, nullable=False, server_default=text("0")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
refunds = Table(
    "payments_refunds",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("charge_id", Text, nullable=False),
    Column("amount", Integer, nullable=False),
    Column("reason", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Called after a refund's rows are written and before they commit: tests and demos use it
# to inject a slow or failing payment provider. None in a real deployment.
Fault = Callable[[str], Awaitable[None]]


class ChargeIn(BaseModel):
    amount: int = Field(gt=0, le=100_000_000)


class RefundIn(BaseModel):
    charge_id: str = Field(min_length=1, max_length=64)
    amount: int = Field(gt=0, le=100_000_000)
    reason: str | None = Field(None, max_length=500)
    client_sent_at: str | None = None  # volatile: excluded from the request hash


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _tenant(request: Request) -> str | None:
    return request.headers.get("x-tenant-id") or None


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) or "body" for e in exc.errors())
        return _error(400, "request.invalid", f"invalid fields: {fields}")


def create_app(
    settings: OutboxSettings,
    engine: AsyncEngine | None = None,
    *,
    fault: Fault | None = None,
    idempotency_ttl: timedelta | None = None,
    lock_timeout: timedelta | None = None,
) -> Starlette:
    """The payments app. Run the framework's migrations first (``outbox db upgrade``)."""
    db = engine or async_engine(settings)
    outbox = Outbox(settings)

    async def create_charge(request: Request) -> Response:
        body = await _parse(request, ChargeIn)
        if isinstance(body, Response):
            return body
        session = idempotency_session(request)
        charge_id = f"ch_{uuid7().hex}"
        await session.execute(
            charges.insert().values(id=charge_id, tenant=_tenant(request), amount=body.amount)
        )
        return JSONResponse({"id": charge_id, "amount": body.amount}, status_code=201)

    async def create_refund(request: Request) -> Response:
        body = await _parse(request, RefundIn)
        if isinstance(body, Response):
            return body
        session = idempotency_session(request)
        tenant = _tenant(request)
        charge = (
            await session.execute(
                select(charges.c.amount, charges.c.refunded)
                .where(charges.c.id == body.charge_id, charges.c.tenant == tenant)
                .with_for_update()
            )
        ).first()
        if charge is None:
            return _error(404, "charge.not_found", f"no charge {body.charge_id}")
        if charge.refunded + body.amount > charge.amount:
            left = charge.amount - charge.refunded
            return _error(422, "refund.amount_exceeds_charge", f"only {left} left to refund")
        refund_id = f"rf_{uuid7().hex}"
        await session.execute(
            refunds.insert().values(
                id=refund_id,
                tenant=tenant,
                charge_id=body.charge_id,
                amount=body.amount,
                reason=body.reason,
            )
        )
        await session.execute(
            charges.update()
            .where(charges.c.id == body.charge_id)
            .values(refunded=charges.c.refunded + body.amount)
        )
        refund = {"id": refund_id, "charge_id": body.charge_id, "amount": body.amount}
        await outbox.publish_async(
            session,
            topic=TOPIC,
            key=body.charge_id,  # per-charge order for consumers
            event_type="refund.created",
            event_id=idempotency_key("refund.created", refund_id),
            payload={**refund, "tenant": tenant},
        )
        if fault is not None:
            await fault(refund_id)
        return JSONResponse({**refund, "status": "pending"}, status_code=201)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with db.begin() as conn:
            await conn.run_sync(metadata.create_all)
        yield
        if engine is None:
            await db.dispose()

    return Starlette(
        routes=[
            Route("/charges", create_charge, methods=["POST"]),
            Route("/refunds", create_refund, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                engine=db,
                settings=settings,
                routes=[("POST", "/charges"), ("POST", "/refunds")],
                principal=_tenant,
                ignore_fields=["client_sent_at"],
                ttl=idempotency_ttl,
                lock_timeout=lock_timeout,
            )
        ],
        lifespan=lifespan,
    )

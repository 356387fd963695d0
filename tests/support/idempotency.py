"""Test helpers for idempotent requests: a domain table whose rows are the "effects", and
an operation that writes one effect row plus one outbox event, like a real handler."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import Outbox, idempotency_key
from outbox.idempotency import StoredResponse

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS idem_effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope text NOT NULL,
    key text NOT NULL,
    amount integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
INSERT_EFFECT = text(
    "INSERT INTO idem_effects (scope, key, amount) VALUES (:scope, :key, :amount) RETURNING id"
)


def create_effects_table(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))


def effect_count(conn: Connection | Engine, scope: str) -> int:
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return effect_count(c, scope)
    return int(
        conn.execute(
            text("SELECT count(*) FROM idem_effects WHERE scope = :s"), {"s": scope}
        ).scalar_one()
    )


def event_id_for(scope: str, key: str) -> uuid.UUID:
    return idempotency_key("idem-test", scope, key)


def outbox_count(engine: Engine, outbox: Outbox, scope: str, key: str) -> int:
    events = outbox.tables.events
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(f'SELECT count(*) FROM "{events.schema}"."{events.name}" WHERE event_id = :e'),
                {"e": event_id_for(scope, key)},
            ).scalar_one()
        )


def record_of(engine: Engine, outbox: Outbox, scope: str, key: str) -> dict[str, Any] | None:
    t = outbox.tables.idempotency
    with engine.connect() as conn:
        row = conn.execute(t.select().where(t.c.scope == scope, t.c.key == key)).mappings().first()
    return dict(row) if row is not None else None


def write_effect(
    session: Session, outbox: Outbox, scope: str, key: str, body: dict[str, Any]
) -> StoredResponse:
    """The domain write of a test request: one effect row + one outbox event, 201."""
    effect_id = session.execute(
        INSERT_EFFECT, {"scope": scope, "key": key, "amount": body["amount"]}
    ).scalar_one()
    outbox.publish(
        session,
        topic="idem-test",
        key=key,
        event_type="effect.created",
        event_id=event_id_for(scope, key),
        payload={"effect_id": effect_id, **body},
    )
    return StoredResponse.json(
        201, {"effect_id": effect_id, **body}, [("x-effect", str(effect_id))]
    )


async def write_effect_async(
    session: AsyncSession, outbox: Outbox, scope: str, key: str, body: dict[str, Any]
) -> StoredResponse:
    effect_id = (
        await session.execute(INSERT_EFFECT, {"scope": scope, "key": key, "amount": body["amount"]})
    ).scalar_one()
    await outbox.publish_async(
        session,
        topic="idem-test",
        key=key,
        event_type="effect.created",
        event_id=event_id_for(scope, key),
        payload={"effect_id": effect_id, **body},
    )
    return StoredResponse.json(
        201, {"effect_id": effect_id, **body}, [("x-effect", str(effect_id))]
    )

"""Shared bench plumbing: settings for a scratch database and a fresh schema per run."""

from __future__ import annotations

import argparse
import uuid

from aiokafka.admin import NewTopic
from sqlalchemy import text

from outbox import OutboxSettings, load_settings, migrate
from outbox.daemon import kafka_admin
from outbox.db import sync_engine


def scratch_settings(args: argparse.Namespace | None = None) -> OutboxSettings:
    """Settings from OUTBOX_* with a fresh schema, migrated, so runs never see old rows."""
    base = load_settings()
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    settings = base.model_copy(update={"db_schema": schema})
    migrate.upgrade(settings)
    return settings


def drop_schema(settings: OutboxSettings) -> None:
    engine = sync_engine(settings)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{settings.db_schema}" CASCADE'))
    engine.dispose()


def payload_300b(n: int) -> dict[str, object]:
    """A realistic ~300-byte order event."""
    return {
        "order_id": f"ord-{n:010d}",
        "customer_id": f"cus-{n % 9973:06d}",
        "currency": "EUR",
        "total_cents": 1000 + n % 50_000,
        "items": [{"sku": f"sku-{n % 317:05d}", "qty": 1 + n % 3, "price_cents": 1999}],
        "shipping": {"country": "DE", "method": "standard", "address_id": f"adr-{n % 811:06d}"},
        "note": "x" * 60,
    }


async def create_topic(
    settings: OutboxSettings,
    partitions: int,
    config: dict[str, str] | None = None,
    prefix: str = "bench",
) -> str:
    """A uniquely named topic (the broker never auto-creates them)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = kafka_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=config or {})])
    finally:
        await admin.close()
    return name

"""Shared bench plumbing: settings for a scratch database and a fresh schema per run, and
topics of the run's own, deleted at its end."""

from __future__ import annotations

import argparse
import uuid

from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaError
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


# This run's topics: a bench that kept them would leave thousands of partitions on the
# broker after a few runs (gigabytes, and minutes of log recovery at its next start).
_created: list[str] = []


async def create_topic(
    settings: OutboxSettings,
    partitions: int,
    config: dict[str, str] | None = None,
    prefix: str = "bench",
    suffix: str = "",
) -> str:
    """A uniquely named topic (the broker never auto-creates them). A ``suffix`` keeps the
    name out of the test sessions' scratch pattern (tests/support/kafka.py), whose clean-up
    deletes every topic of that shape created while a session ran, a bench's included."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}{suffix}"
    admin = kafka_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=config or {})])
    finally:
        await admin.close()
    _created.append(name)
    return name


async def delete_topics(settings: OutboxSettings) -> None:
    """Delete the topics this run created, and the dead-letter topics made for them."""
    if not _created:
        return
    admin = kafka_admin(settings)
    await admin.start()
    try:
        ours = {*_created, *(t + settings.consumer.dlq_suffix for t in _created)}
        await admin.delete_topics(sorted(ours & set(await admin.list_topics())))
        _created.clear()
    except KafkaError as exc:
        print(f"could not delete this run's topics ({type(exc).__name__}): {sorted(ours)}")
    finally:
        await admin.close()

"""Shared bench plumbing: settings for a scratch database and a fresh schema per run, and
topics of the run's own, deleted at its end; the environment of a relay it starts."""

from __future__ import annotations

import argparse
import fcntl
import os
import uuid
from typing import IO

from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaError
from sqlalchemy import text

from outbox import OutboxSettings, load_settings, migrate
from outbox.db import sync_engine
from outbox.kafka.clients import kafka_admin, kafka_environment
from tests.support.kafka import scratch_lock


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
# A test session that ends deletes the scratch topics created during its run unless another
# session holds this lock; a benchmark holds it too, from its first topic to its exit, or a
# test run ending beside it deletes the topic it is reading (the benchmark then waits
# forever on metadata errors).
_sharing: list[IO[str]] = []


def _share_broker(settings: OutboxSettings) -> None:
    if not _sharing:
        f = scratch_lock(settings.kafka_bootstrap_servers).open("a")
        fcntl.flock(f, fcntl.LOCK_SH)
        _sharing.append(f)  # released when the process exits


async def create_topic(
    settings: OutboxSettings,
    partitions: int,
    config: dict[str, str] | None = None,
    prefix: str = "bench",
) -> str:
    """A uniquely named topic (the broker never auto-creates them)."""
    _share_broker(settings)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
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


def relay_env(settings: OutboxSettings) -> dict[str, str]:
    # OUTBOX_RELAY__* from the caller's environment pass through (tuning experiments).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_RELAY__")
    }
    env.setdefault("OUTBOX_RELAY__HEARTBEAT_SECONDS", "0.5")
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        OUTBOX_DB_SCHEMA=settings.db_schema,
        OUTBOX_SOURCE=settings.source,
        OUTBOX_WAL__SLOT=settings.wal.slot,
        OUTBOX_WAL__PUBLICATION=settings.wal.publication,
        **kafka_environment(settings),
    )
    return env

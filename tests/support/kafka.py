"""Kafka helpers for tests: topics with unique names, reading a topic to the end."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic


async def create_topic(bootstrap: str, name: str | None = None, partitions: int = 1) -> str:
    name = name or f"t-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]


async def read_all(
    bootstrap: str, topic: str, expect: int, wait_seconds: float = 60.0
) -> list[Record]:
    """Read ``topic`` from the beginning until ``expect`` records arrived or time ran out."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
    )
    await consumer.start()
    records: list[Record] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while len(records) < expect and loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=10_000)
            for msgs in batch.values():
                records.extend(
                    Record(m.topic, m.partition, m.offset, m.key, m.value, dict(m.headers))
                    for m in msgs
                )
    finally:
        await consumer.stop()
    return records

"""Kafka helpers for tests: topics with unique names, reading a topic to the end."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
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


async def read_until(
    bootstrap: str,
    topic: str,
    done: Callable[[Record], bool],
    wait_seconds: float = 60.0,
) -> list[Record]:
    """Read ``topic`` from the beginning, feeding each record to ``done``, until it returns
    True or time ran out. Returns every record read (duplicates included)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
    )
    await consumer.start()
    records: list[Record] = []
    finished = False
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while not finished and loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=10_000)
            for msgs in batch.values():
                for m in msgs:
                    record = Record(m.topic, m.partition, m.offset, m.key, m.value, dict(m.headers))
                    records.append(record)
                    finished = done(record) or finished
    finally:
        await consumer.stop()
    return records


async def read_all(
    bootstrap: str, topic: str, expect: int, wait_seconds: float = 60.0
) -> list[Record]:
    """Read ``topic`` from the beginning until ``expect`` records arrived or time ran out."""
    seen = 0

    def enough(_: Record) -> bool:
        nonlocal seen
        seen += 1
        return seen >= expect

    if expect <= 0:
        return []
    return await read_until(bootstrap, topic, enough, wait_seconds)

"""Kafka helpers for tests: topics with unique names, reading a topic to the end."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType


async def create_topic(bootstrap: str, name: str | None = None, partitions: int = 1) -> str:
    name = name or f"t-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


async def cleanup_policies(bootstrap: str, topics: list[str]) -> dict[str, str]:
    """Each topic's ``cleanup.policy`` as the broker reports it (``delete``, ``compact``)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found: dict[str, str] = {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
        for response in await admin.describe_configs(resources):
            for _, _, _, name, entries in response.resources:
                found.update((name, str(v)) for k, v, *_ in entries if k == "cleanup.policy")
        return found
    finally:
        await admin.close()


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServicesFailed(RuntimeError):
    pass


@contextmanager
def private_broker(state: Path) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A broker of our own, from scripts/services (stopping the shared one would break
    everyone else's tests): yields its bootstrap address and ``services(cmd)`` to run
    ``kafka-stop`` / ``kafka-start`` on it."""
    root = Path(__file__).resolve().parents[2]
    port, controller = free_port(), free_port()
    env = {
        **os.environ,
        "OUTBOX_SERVICES_DIR": str(state),
        "OUTBOX_KAFKA_PORT": str(port),
        "OUTBOX_KAFKA_CONTROLLER_PORT": str(controller),
        # Without a SASL_SSL listener: its default port is the shared broker's.
        "OUTBOX_KAFKA_SASL_SSL_PORT": "0",
    }

    def services(cmd: str) -> None:
        res = subprocess.run(
            [str(root / "scripts" / "services"), cmd],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if res.returncode != 0:
            raise ServicesFailed(f"private Kafka {cmd} failed: {res.stderr[-2000:]}")

    services("kafka-start")
    try:
        yield f"127.0.0.1:{port}", services
    finally:
        services("kafka-stop")

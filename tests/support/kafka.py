"""Kafka helpers for tests: topics with unique names, reading a topic to the end."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import re
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError


async def create_topic(
    bootstrap: str,
    name: str | None = None,
    partitions: int = 1,
    configs: dict[str, str] | None = None,
) -> str:
    name = name or f"t-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs or {})])
    finally:
        await admin.close()
    return name


# How the tests and benchmarks name their topics: a word, then a random hex suffix (and a
# dead-letter suffix). A user's topics created on the same broker during a run are not
# taken for the tests' own.
_SCRATCH = re.compile(r"[a-z][a-z0-9_-]*-[0-9a-f]{6,}(\.[a-z]+)?")


async def _topic_names(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def _delete_topics(bootstrap: str, names: set[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(sorted(names), timeout_ms=60_000)
    finally:
        await admin.close()


def scratch_lock(bootstrap: str) -> Path:
    """The lock file of the test sessions (and benchmarks) sharing the broker at
    ``bootstrap``: each holds it shared while its topics are in use."""
    digest = hashlib.sha256(bootstrap.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"outbox-tests-{digest}.lock"


@contextmanager
def scratch_topics_deleted(bootstrap: str) -> Iterator[None]:
    """Delete, at the end, the scratch topics created meanwhile: every test uses topics of
    its own, and a broker that kept them all would hold thousands of partitions after a
    few runs (gigabytes on disk, minutes of log recovery at its next start).

    Other test sessions may use the same broker at the same time: each holds a shared lock
    for its whole run, and a session deletes only when it can take the lock alone — the
    last one out. A session starting meanwhile waits for that cleanup before it looks."""
    with scratch_lock(bootstrap).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            before = asyncio.run(_topic_names(bootstrap))
        except KafkaError:
            before = None  # the test that needs Kafka says so; nothing to clean then
        yield
        fcntl.flock(f, fcntl.LOCK_UN)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another session runs: the last one deletes
        if before is None:
            return
        with suppress(KafkaError):  # a broker gone by now keeps them; the next run deletes
            left = {
                t for t in asyncio.run(_topic_names(bootstrap)) - before if _SCRATCH.fullmatch(t)
            }
            if left:
                asyncio.run(_delete_topics(bootstrap, left))


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
    timestamp: int = -1  # ms since the epoch (the producer's or the broker's clock)


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
                    record = Record(
                        m.topic, m.partition, m.offset, m.key, m.value, dict(m.headers), m.timestamp
                    )
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

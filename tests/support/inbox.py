"""Helpers for inbox tests: CloudEvents records, an effects table, running consumers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from inbox import Consumer, ConsumerDaemon, Metrics
from outbox import Message, Outbox
from outbox.db import sync_engine
from outbox.settings import ConsumerSettings, OutboxSettings, RetrySettings

ROOT = Path(__file__).resolve().parents[2]
Headers = list[tuple[str, bytes]]


def ce_headers(event_id: str, event_type: str = "test.event", **extra: str) -> Headers:
    headers = [
        ("ce_id", event_id.encode()),
        ("ce_type", event_type.encode()),
        ("ce_source", b"urn:test"),
        ("ce_specversion", b"1.0"),
        ("content-type", b"application/json"),
    ]
    return headers + [(k, v.encode()) for k, v in extra.items()]


async def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None, Headers]],
    partition: int | None = None,
    max_request_size: int = 1_048_576,
    compression_type: str | None = None,
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        max_request_size=max_request_size,
        compression_type=compression_type,
    )
    await producer.start()
    try:
        futures = [
            await producer.send(topic, value, key=key, headers=headers, partition=partition)
            for key, value, headers in records
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def fast_settings(settings: OutboxSettings, **consumer: Any) -> OutboxSettings:
    return settings.model_copy(
        update={
            "retry": RetrySettings(base_seconds=0.01, cap_seconds=0.05),
            "consumer": ConsumerSettings(**{"max_attempts": 3, **consumer}),
        }
    )


def effects_table(engine: Engine) -> str:
    """A fresh table the test handlers write their effects into."""
    name = f"effects_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {name} (id bigserial PRIMARY KEY, event_id text NOT NULL, "
                "key text, seq int, committed_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        )
    return name


def effect_counts(engine: Engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT event_id, count(*) FROM {table} GROUP BY event_id"))
        return {r[0]: r[1] for r in rows}


def effect_rows(engine: Engine, table: str) -> list[tuple[str, str | None, int | None]]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT event_id, key, seq FROM {table} ORDER BY id"))
        return [(r[0], r[1], r[2]) for r in rows]


def publish_keyed(
    settings: OutboxSettings,
    topic: str,
    events: int,
    *,
    keys: int,
    chunk: int = 200,
    pause: float = 0.05,
    stop: threading.Event | None = None,
) -> None:
    """Publish ``events`` events of type ``test.event`` (payload {"key", "seq"}, seq rising
    per key) through ``sync_engine(settings)``, ``chunk`` per transaction with a ``pause``
    between them (so that kills land mid-stream); ``stop`` ends it early."""
    stop = stop or threading.Event()
    engine = sync_engine(settings, pool_size=1)
    outbox = Outbox(settings)
    try:
        for start in range(0, events, chunk):
            if stop.is_set():
                return
            with Session(engine) as session, session.begin():
                outbox.publish_many(
                    session,
                    [
                        Message(
                            topic=topic,
                            key=f"key-{n % keys}",
                            event_type="test.event",
                            payload={"key": f"key-{n % keys}", "seq": n // keys},
                        )
                        for n in range(start, min(start + chunk, events))
                    ],
                )
            stop.wait(pause)
    finally:
        engine.dispose()


def effect_verdict(
    rows: Sequence[tuple[str, str | None, int | None]], expected: int
) -> tuple[int, int, int]:
    """(lost, duplicate effects, out-of-order pairs per key) of :func:`effect_rows` (commit
    order) for ``expected`` events, each a distinct (key, seq) with seq rising per key."""
    seen: dict[tuple[str, int], int] = {}
    last: dict[str, int] = {}
    out_of_order = 0
    for _, key, seq in rows:
        assert key is not None and seq is not None
        seen[(key, seq)] = seen.get((key, seq), 0) + 1
        if seq < last.get(key, -1):
            out_of_order += 1
        last[key] = max(seq, last.get(key, -1))
    return expected - len(seen), sum(c - 1 for c in seen.values()), out_of_order


async def until(condition: Callable[[], bool], within: float) -> bool:
    """Whether ``condition`` became true within ``within`` seconds (polled every 0.2 s)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 60.0,  # noqa: ASYNC109
    what: str = "",
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.1)


class RunningConsumer:
    """A consumer daemon running in this process (``async with``)."""

    def __init__(self, app: Consumer, settings: OutboxSettings) -> None:
        self.metrics = Metrics(app.name)
        self.daemon = ConsumerDaemon(app, settings, self.metrics)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RunningConsumer:
        self.task = asyncio.create_task(self.daemon.run(self.stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 60)

    def assigned(self) -> bool:
        kafka = self.daemon._kafka
        return kafka is not None and bool(kafka.assignment())


def subprocess_env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        OUTBOX_KAFKA_BOOTSTRAP_SERVERS=settings.kafka_bootstrap_servers,
        OUTBOX_RETRY__BASE_SECONDS="0.01",
        OUTBOX_RETRY__CAP_SECONDS="0.05",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def outbox_cli(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["outbox", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def committed_offsets(bootstrap: str, group: str) -> dict[tuple[str, int], int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}


def numbered_body(seq: int, bad: bool) -> bytes:
    """A test event's value, key "k": ``bad`` fails both test apps' handlers
    ("permanent" the per-event one of inbox_apps, "bad" the batch one of batch_apps, which
    names the event)."""
    extra = {"permanent": True, "bad": True} if bad else {}
    return json.dumps({"key": "k", "seq": seq, **extra}).encode()


def dlq_show(env: dict[str, str], group: str, event_ids: list[str]) -> dict[str, str]:
    """`outbox dlq show` of each event, by event id (the CLI runs in parallel: each start
    costs seconds)."""
    procs = {
        event_id: subprocess.Popen(
            ["outbox", "dlq", "show", event_id, "--consumer", group],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for event_id in event_ids
    }
    shown = {}
    for event_id, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        shown[event_id] = out.decode()
    return shown

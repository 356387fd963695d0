"""No record stops a consumer: NUL bytes in the id, the type, the source, the key and a
header, from foreign producers (librdkafka through confluent-kafka, raw aiokafka), ahead of
good records on the same partition. `outbox consume` runs as a subprocess, with a per-event
and with a batch handler."""

from __future__ import annotations

import asyncio
import signal
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable

import pytest
from aiokafka import AIOKafkaProducer
from confluent_kafka import Producer
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.support.console import chromium_browser, console_process
from tests.support.inbox import (
    Headers,
    ce_headers,
    dlq_show,
    effect_counts,
    effects_table,
    numbered_body,
    outbox_cli,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
Record = tuple[bytes | None, bytes, Headers]


def _hostile(run: str) -> dict[str, Record]:
    """Event id (as the inbox knows it) -> the record. The first two cannot be read (no
    id or type PostgreSQL can store: dead-lettered as malformed, under their position);
    the other three are events whose handler refuses them (dead-lettered as failures)."""
    return {
        "@0": (b"k", numbered_body(0, False), ce_headers(f"{run}-type", "test.\x00event")),
        "@1": (b"k", numbered_body(1, False), ce_headers(f"{run}-\x00id")),
        f"{run}-source": (
            b"k",
            numbered_body(2, True),
            ce_headers(f"{run}-source", ce_source="urn:\x00"),
        ),
        f"{run}-key": (b"k\x00ey", numbered_body(3, True), ce_headers(f"{run}-key")),
        f"{run}-header": (
            b"k",
            numbered_body(4, True),
            [*ce_headers(f"{run}-header"), ("user\x00name", b"v\x00\xff")],
        ),
    }


def _produce_confluent(bootstrap: str, topic: str, records: list[Record]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    for key, value, headers in records:
        producer.produce(topic, value=value, key=key, headers=headers, partition=0)
    assert producer.flush(30) == 0


async def _produce_raw(bootstrap: str, topic: str, records: list[Record]) -> None:
    """librdkafka cuts a header name at its NUL; aiokafka sends it whole."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, value, key=key, headers=headers, partition=0)
    finally:
        await producer.stop()


def _dead_letters(
    engine: Engine, settings: OutboxSettings, group: str
) -> dict[str, tuple[bytes | None, list[bytes]]]:
    table = f'"{settings.db_schema}"."{settings.table_prefix}dead_letters"'
    with engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT event_id, key, header_values FROM {table} WHERE consumer = :c"),
            {"c": group},
        )
        return {r[0]: (r[1], [bytes(v) for v in r[2]]) for r in rows}


async def _console_shows_them_escaped(
    settings: OutboxSettings, group: str, topic: str, run: str
) -> None:
    """The console's dead-letter page, in Chromium, shows the bytes as `outbox dlq show`
    does: escaped, never a raw NUL or a replacement character."""
    async with chromium_browser() as browser:
        page = await browser.new_page()
        with console_process(settings) as (url, proc):

            async def shown(event_id: str, selector: str) -> str:
                query = urllib.parse.urlencode({"consumer": group, "event_id": event_id})
                response = await page.goto(f"{url}/dead-letters/show?{query}")
                assert response is not None and response.status == 200, event_id
                return await page.inner_text(selector)

            assert await shown(f"{run}-key", "#key") == "k\\x00ey"
            headers = await shown(f"{run}-header", "#headers")
            assert "user\\x00name" in headers and "v\\x00\\xff" in headers, headers
            assert "test.\\x00event" in await shown(f"{topic}:0:0", "body")
            assert f"{run}-\\x00id" in await shown(f"{topic}:0:1", "#headers")
            assert "urn:\\x00" in await shown(f"{run}-source", "#headers")
        await page.close()
    assert b"Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "target",
    ["tests.support.inbox_apps:app", "tests.support.batch_apps:app"],
    ids=["event", "batch"],
)
async def test_nul_bytes_anywhere_are_dead_lettered_and_the_partition_moves_on(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    target: str,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    group = f"c-{uuid.uuid4().hex[:8]}"
    run = uuid.uuid4().hex[:6]
    hostile = _hostile(run)
    ids = {name.replace("@", f"{topic}:0:"): record for name, record in hostile.items()}
    good = [(b"k", numbered_body(10 + i, False), ce_headers(f"{run}-good-{i}")) for i in range(10)]
    records = list(hostile.values())
    _produce_confluent(kafka_bootstrap, topic, records[:4])
    await _produce_raw(kafka_bootstrap, topic, records[4:])
    _produce_confluent(kafka_bootstrap, topic, good)

    env = subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=group,
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        INBOX_TEST_MAX_ATTEMPTS="2",
    )
    consumer = outbox_cli(["consume", target], env)
    try:
        await wait_for(
            lambda: consumer.poll() is not None or len(effect_counts(engine, table)) == 10,
            what="the 10 good records applied",
        )
        await wait_for(
            lambda: consumer.poll() is not None or len(_dead_letters(engine, settings, group)) == 5,
            what="the 5 hostile records dead-lettered",
        )
        await asyncio.sleep(1.0)
        assert consumer.poll() is None, consumer.stderr.read().decode() if consumer.stderr else ""

        assert effect_counts(engine, table) == {f"{run}-good-{i}": 1 for i in range(10)}
        stored = _dead_letters(engine, settings, group)
        assert set(stored) == set(ids)
        for event_id, (key, _, headers) in ids.items():
            # The table keeps the key and header values byte for byte.
            assert stored[event_id] == (key, [v for _, v in headers]), event_id
        # The dead-letter topic has the records exactly as they came, header names too.
        dlq = await read_all(kafka_bootstrap, topic + ".dlq", expect=5)
        by_id = {r.headers["dlq_event_id"].decode(): r for r in dlq}
        for event_id, (key, value, headers) in ids.items():
            copy = by_id[event_id]
            assert copy.key == key and copy.value == value
            assert {n: v for n, v in copy.headers.items() if not n.startswith("dlq_")} == dict(
                headers
            )

        shown = dlq_show(env, group, list(ids))
        assert "type: test.\\x00event" in shown[f"{topic}:0:0"]
        assert "MalformedRecord: ce_type header holds a NUL byte" in shown[f"{topic}:0:0"]
        assert f"header ce_id = {run}-\\x00id" in shown[f"{topic}:0:1"]
        assert "MalformedRecord: ce_id header holds a NUL byte" in shown[f"{topic}:0:1"]
        assert "header ce_source = urn:\\x00" in shown[f"{run}-source"]
        assert "key: b'k\\x00ey'" in shown[f"{run}-key"]
        assert "header user\\x00name = v\\x00\\xff" in shown[f"{run}-header"]
        assert all("\x00" not in out for out in shown.values())
        if target.endswith("inbox_apps:app"):  # the console reads the same rows either way
            await _console_shows_them_escaped(settings, group, topic, run)
    finally:
        if consumer.poll() is None:
            consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(60) == 0

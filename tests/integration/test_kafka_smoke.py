"""The broker the tests use really accepts and returns records (aiokafka, acks=all)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from aiokafka import AIOKafkaProducer

from tests.support.kafka import read_all

pytestmark = pytest.mark.integration


async def test_produce_and_consume_one_record(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    topic = await new_topic(partitions=1)
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"hello", key=b"k", headers=[("ce_id", b"1")])
    finally:
        await producer.stop()
    assert meta.offset == 0
    records = await read_all(kafka_bootstrap, topic, expect=1, wait_seconds=30)
    assert [(r.key, r.value, r.headers["ce_id"]) for r in records] == [(b"k", b"hello", b"1")]

"""The canary: every aiokafka internal of the Kafka room (outbox/kafka/aiokafka_internals.py)
exercised against the installed aiokafka and a real broker, so that an aiokafka release that moves
one fails here, by name, instead of turning a fix into a silent no-op in production.
scripts/test runs this file (and a few Kafka tests) against the lowest aiokafka the
project allows too. Last: a vanished internal costs one WARNING, never the delivery."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiokafka
import aiokafka.conn
import aiokafka.protocol.metadata
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import ProducerClosed
from sqlalchemy import Engine

import inbox
from outbox.kafka import aiokafka_internals
from outbox.settings import OutboxSettings
from relay import Relay
from tests.support.inbox import RunningConsumer, ce_headers, produce, wait_for
from tests.support.relay import fast, publish_numbered, read_ids, verdict

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def room() -> Iterator[None]:
    aiokafka_internals.check(again=True)
    yield
    aiokafka_internals.check(again=True)


def test_the_installed_aiokafka_has_every_capability() -> None:
    assert aiokafka_internals.check(again=True) == {}, aiokafka.__version__


class _Picks:
    """A broker choice that records being asked and answers like aiokafka would."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, client: Any) -> int | None:
        self.asked += 1
        nodes = [b.nodeId for b in client.cluster.brokers()]
        return nodes[0] if nodes else None


async def test_broker_choice_reaches_producer_ids_admin_requests_and_coordinator_lookups(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    topic = await new_topic()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, group_id=f"canary-{uuid.uuid4().hex[:8]}"
    )
    picks = {"producer": _Picks(), "admin": _Picks(), "consumer": _Picks()}
    assert aiokafka_internals.prefer_brokers(producer, picks["producer"])
    assert aiokafka_internals.prefer_brokers(admin, picks["admin"])
    assert aiokafka_internals.prefer_brokers(consumer, picks["consumer"])
    try:
        await producer.start()  # the idempotent producer's id: a broker "at random"
        await admin.start()
        assert topic in await admin.list_topics()
        await consumer.start()
        await consumer.getmany(timeout_ms=3000)  # joins: the group coordinator lookup
        await wait_for(lambda: bool(consumer.assignment()), what="assignment")
    finally:
        await consumer.stop()
        await admin.close()
        await producer.stop()
    assert {name: p.asked > 0 for name, p in picks.items()} == dict.fromkeys(picks, True)


async def test_a_metadata_request_to_a_chosen_broker_updates_the_clients_view(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    await consumer.start()
    try:
        topic = await new_topic(partitions=3)  # after the start: the consumer knows nothing of it
        for owner in (admin, consumer):
            client = aiokafka_internals.client_of(owner)
            node = client.cluster.brokers().pop().nodeId
            answer = await aiokafka_internals.ask_metadata(owner, node, [topic])
            described = answer.to_object()
            assert {int(b["node_id"]) for b in described["brokers"]} >= {node}
            (only,) = described["topics"]
            assert only["topic"] == topic
            assert sorted(p["partition"] for p in only["partitions"]) == [0, 1, 2]
            assert all(p["leader"] >= 0 and p["isr"] for p in only["partitions"])
        # The consumer never asked for the topic: after the update it knows its leaders.
        client = aiokafka_internals.client_of(consumer)
        assert client.cluster.partitions_for_topic(topic) is None
        aiokafka_internals.update_cluster(consumer, answer)
        assert client.cluster.partitions_for_topic(topic) == {0, 1, 2}
        assert client.cluster.leader_for_partition(TopicPartition(topic, 0)) is not None
    finally:
        await consumer.stop()
        await admin.close()
    assert aiokafka_internals.usable(aiokafka_internals.METADATA)  # nothing failed in use


async def test_abandoning_queued_batches_fails_them_and_lets_the_producer_stop(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    topic = await new_topic()
    # A long linger keeps the batch queued, as a dead broker's batches are.
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, enable_idempotence=True, linger_ms=60_000
    )
    await producer.start()
    try:
        batch = producer.create_batch()
        batch.append(key=b"k", value=b"v", timestamp=None)
        future = await producer.send_batch(batch, topic, partition=0)
        assert not future.done()
        assert aiokafka_internals.abandon_queued(producer, ProducerClosed())
        with pytest.raises(ProducerClosed):
            await asyncio.wait_for(future, 5)
    finally:
        await asyncio.wait_for(producer.stop(), 10)
    assert aiokafka_internals.usable(aiokafka_internals.ABANDON)


async def test_the_fetch_wait_is_read_and_changed_on_a_running_consumer(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    topic = await new_topic()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, fetch_max_wait_ms=300)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.getmany(timeout_ms=200)
        assert aiokafka_internals.fetch_wait(consumer) == (1, 300)
        # The broker now holds each fetch until 1 MiB or 2 s: a single record waits.
        assert aiokafka_internals.set_fetch_wait(consumer, 1 << 20, 2000)
        assert aiokafka_internals.fetch_wait(consumer) == (1 << 20, 2000)
        await asyncio.sleep(0.5)  # the fetch in flight with the old settings ends
        await produce(kafka_bootstrap, topic, [(b"k", b"v", [])])
        started = time.monotonic()
        got: list[Any] = []
        while not got and time.monotonic() - started < 10:
            batches = await consumer.getmany(timeout_ms=100)
            got = [r for records in batches.values() for r in records]
        held = time.monotonic() - started
    finally:
        await consumer.stop()
    assert got and held > 0.8, held  # answered at once (~10 ms) with the old settings


async def test_a_group_members_generation_is_read_and_its_member_id_reset(
    kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]
) -> None:
    topic = await new_topic()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, group_id=f"canary-{uuid.uuid4().hex[:8]}"
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200)
        assert consumer.assignment()
        generation = aiokafka_internals.group_generation(consumer)
        assert generation is not None and generation >= 1
        assert aiokafka_internals.reset_group_member(consumer)
        assert aiokafka_internals.group_generation(consumer) == -1  # a fresh join comes next
    finally:
        await consumer.stop()
    # Kafka error 82 gets a name (aiokafka 0.14 calls it UnknownError).
    from inbox.membership import FENCED_INSTANCE_ID, FencedInstanceIdError

    assert aiokafka_internals.name_error_code(FENCED_INSTANCE_ID, FencedInstanceIdError)
    assert aiokafka.errors.for_code(FENCED_INSTANCE_ID) is FencedInstanceIdError


async def test_a_header_name_not_utf8_is_read_escaped_from_a_real_fetch(
    kafka_bootstrap: str,
    new_topic: Callable[..., Awaitable[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokafka.consumer import fetcher

    from outbox.kafka.client import UndecodedHeader
    from tests.support.raw_headers import RawName, produce_raw_names

    topic = await new_topic()
    bad = RawName(b"n\xff")
    await produce_raw_names(
        kafka_bootstrap, topic, [(b"k", b"0", [("ok", b"")]), (b"k", b"1", [(bad, b"v")])]
    )
    await produce(kafka_bootstrap, topic, [(b"k", b"2", [])], partition=0)
    monkeypatch.setattr(fetcher, "MemoryRecords", fetcher.MemoryRecords)  # put back after
    assert aiokafka_internals.install_lenient_header_names()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + 20
        while len(got) < 3 and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            got += [r for records in batches.values() for r in records]
    finally:
        await consumer.stop()
    assert [r.value for r in got] == [b"0", b"1", b"2"]
    assert got[1].headers == (("n\\xff", b"v"),) and type(got[1].headers[0]) is UndecodedHeader


def test_the_oauthbearer_exchange_is_installed_over_aiokafkas() -> None:
    assert aiokafka_internals.install_oauth_exchange()
    installed = aiokafka.conn.OAuthAuthenticator
    assert installed.__module__ == "outbox.kafka.aiokafka_internals"
    base = installed.__bases__[0]
    assert base.__module__ == "aiokafka.conn" and callable(base.step)  # aiokafka's, extended


# ----------------------------------------------------- an internal that vanished: fallback


def _room_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "outbox.kafka" and r.levelno == logging.WARNING]


async def test_a_relay_without_metadata_requests_warns_once_and_delivers(
    engine: Engine,
    isolated_settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.kafka")
    monkeypatch.delattr(aiokafka.protocol.metadata, "MetadataRequest")
    aiokafka_internals._lost = None  # the relay's start runs the check
    settings = isolated_settings
    topic = await new_topic(partitions=3)
    ids = publish_numbered(engine, settings, topic, 200, keys=10)
    await running(fast(settings))
    records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order) == (0, 0), v
    (warning,) = _room_warnings(caplog)
    message = warning.getMessage()
    assert f"aiokafka {aiokafka.__version__}" in message
    assert "leader watch disabled" in message and "MetadataRequest" in message


async def test_a_consumer_without_metadata_requests_warns_once_and_consumes(
    isolated_settings: OutboxSettings,
    kafka_bootstrap: str,
    new_topic: Callable[..., Awaitable[str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.kafka")
    monkeypatch.delattr(aiokafka.protocol.metadata, "MetadataRequest")
    aiokafka_internals._lost = None  # the consumer's start runs the check
    topic = await new_topic()
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])
    handled: list[str] = []

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: Any) -> None:
        handled.append(event.event_id)

    c = RunningConsumer(app, isolated_settings)
    async with c:
        await wait_for(c.assigned, what="assignment")
        sent = [f"e-{uuid.uuid4()}" for _ in range(5)]
        await produce(kafka_bootstrap, topic, [(b"k", b"{}", ce_headers(i)) for i in sent])
        await wait_for(lambda: len(handled) >= 5, what="records")
        await asyncio.sleep(1.5)  # a metadata watch round, through the public fallback
        assert c.daemon.healthy() and c.daemon.kafka.up
    assert sorted(handled) == sorted(sent)
    (warning,) = _room_warnings(caplog)
    assert "MetadataRequest" in warning.getMessage()
    assert aiokafka.__version__ in warning.getMessage()

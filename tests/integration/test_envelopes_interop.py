"""Producers we did not write, on real Kafka and PostgreSQL: the CloudEvents SDK in binary
and structured mode and a Debezium-shaped outbox router, both through librdkafka
(confluent-kafka), and a JSON-body producer (aiokafka). Every event is sent twice.

Counted: events applied (each exactly once), duplicates, out-of-order pairs per key (0);
one unreadable record per envelope dead-lettered with the envelope's reason and replayed
with ``outbox dlq replay`` through the same envelopes; and the consumer's own lag gauge.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from confluent_kafka import Producer
from pydantic import BaseModel
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox import DeadLetterFilter, DeadLetters, EventContext
from inbox.envelopes import Generic, Pointer
from inbox.errors import EnvelopeError
from outbox.settings import OutboxSettings
from tests.support.inbox import (
    RunningConsumer,
    committed_offsets,
    effect_counts,
    effect_rows,
    effects_table,
    fast_settings,
    produce,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
Message = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]
KEYS, SEQS = 4, 6  # per producer: 24 events, 48 records
JSON_BODY = Generic(id=Pointer("/meta/id"), type=Pointer("/meta/type"), payload=Pointer("/data"))


class Thing(BaseModel):
    key: str
    seq: int


def name() -> str:
    return f"interop-{uuid.uuid4().hex[:8]}"


def twice(events: list[Message]) -> list[Message]:
    """Each event sent twice: half of them again at once (a duplicate in the same fetch),
    the other half at the end (a redelivery much later). First copies stay in key order."""
    out: list[Message] = []
    for i, message in enumerate(events):
        out += [message, message] if i % 2 == 0 else [message]
    return out + [m for i, m in enumerate(events) if i % 2 == 1]


def rdkafka_produce(bootstrap: str, topic: str, messages: list[Message]) -> None:
    """librdkafka, idempotent, acks=all: the client most non-Python services use."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    for key, value, headers in messages:
        producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
    assert producer.flush(30) == 0 and not failed, failed


def cloudevents(mode: str) -> list[Message]:
    """Events written by the CloudEvents SDK's Kafka binding."""
    out: list[Message] = []
    for seq in range(SEQS):
        for k in range(KEYS):
            key = f"{mode[0]}{k}"
            event = CloudEvent(
                attributes={
                    "id": f"ce-{mode}-{key}-{seq}-{uuid.uuid4().hex[:6]}",
                    "type": "thing.happened",
                    "source": "urn:sdk",
                    "specversion": "1.0",
                    "partitionkey": key,
                    "datacontenttype": "application/json",
                },
                data={"key": key, "seq": seq},
            )
            to = ce_kafka.to_binary if mode == "binary" else ce_kafka.to_structured
            m = to(event, JSONFormat())
            out.append((key.encode(), m.value, list(m.headers.items())))
    return out


def debezium() -> list[Message]:
    """The outbox event router's records: header ``id``, key = aggregate id, the payload
    as the value in its three JSON shapes (string, bare, JsonConverter wrapper)."""
    out: list[Message] = []
    for seq in range(SEQS):
        for k in range(KEYS):
            key, payload = f"d{k}", json.dumps({"key": f"d{k}", "seq": seq})
            value = [
                json.dumps(payload),
                payload,
                json.dumps({"schema": {"type": "string"}, "payload": payload}),
            ][seq % 3]
            headers = [("id", str(uuid.uuid4()).encode())]
            out.append((key.encode(), value.encode(), headers))
    return out


def json_body() -> list[Message]:
    """A service writing plain JSON with its own metadata block."""
    return [
        (
            f"j{k}".encode(),
            json.dumps(
                {
                    "meta": {"id": f"j-{k}-{seq}-{uuid.uuid4().hex[:6]}", "type": "thing.happened"},
                    "data": {"key": f"j{k}", "seq": seq},
                }
            ).encode(),
            [],
        )
        for seq in range(SEQS)
        for k in range(KEYS)
    ]


def recording(app: inbox.Consumer, table: str, topic: str) -> None:
    """One typed handler (CloudEvents, JSON body) and one for Debezium's untyped topic."""

    async def record(thing: Thing, session: AsyncSession, ctx: EventContext) -> None:
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": ctx.event_id, "k": thing.key, "s": thing.seq},
        )

    app.handler("thing.happened")(record)
    app.handler(topic=topic)(record)


def out_of_order_pairs(rows: list[tuple[str, str | None, int | None]]) -> int:
    last: dict[str | None, int] = {}
    bad = 0
    for _, key, seq in rows:
        assert seq is not None
        if key in last and seq <= last[key]:
            bad += 1
        last[key] = seq
    return bad


async def test_every_producers_events_are_applied_once_in_key_order(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    ce, dbz, body = [await new_topic(partitions=3) for _ in range(3)]
    table = effects_table(engine)
    app = inbox.Consumer(
        name=name(), topics=[ce, dbz, body], envelopes={dbz: "debezium", body: JSON_BODY}
    )
    recording(app, table, dbz)
    binary, structured, outbox_router, plain = (
        cloudevents("binary"),
        cloudevents("structured"),
        debezium(),
        json_body(),
    )
    # Both CloudEvents content modes on one topic: the mode is recognised per record.
    mixed = [m for pair in zip(binary, structured, strict=True) for m in pair]
    await asyncio.to_thread(rdkafka_produce, kafka_bootstrap, ce, twice(mixed))
    await asyncio.to_thread(rdkafka_produce, kafka_bootstrap, dbz, twice(outbox_router))
    await produce(kafka_bootstrap, body, twice(plain))
    events = len(mixed) + len(outbox_router) + len(plain)
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(
            lambda: c.metrics.counts["processed"] + c.metrics.counts["duplicates"] >= 2 * events,
            what="every record handled",
        )
    counts = effect_counts(engine, table)
    assert len(counts) == events and set(counts.values()) == {1}  # applied once, 0 duplicates
    # The dedupe key is each producer's own id: CloudEvents id, Debezium's id header, meta.id.
    produced_ids = {
        *(h.decode() for _, _, headers in binary for n, h in headers if n == "ce_id"),
        *(json.loads(v or b"")["id"] for _, v, _ in structured),
        *(h.decode() for _, _, headers in outbox_router for _, h in headers),
        *(json.loads(v or b"")["meta"]["id"] for _, v, _ in plain),
    }
    assert set(counts) == produced_ids
    assert c.metrics.counts["duplicates"] == events
    assert c.metrics.counts["dead_lettered"] == 0 and c.metrics.counts["skipped"] == 0
    assert out_of_order_pairs(effect_rows(engine, table)) == 0


def unreadable_records() -> dict[str, tuple[Any, Message, str]]:
    """Per envelope: (envelope, a record it cannot read, the reason it must give)."""
    return {
        "cloudevents": (
            "cloudevents",
            (b"k", b"[]", [("content-type", b"application/cloudevents-batch+json")]),
            "cloudevents: batch content mode (application/cloudevents-batch+json) is not "
            "defined for Kafka; send one event per record",
        ),
        "debezium": (
            "debezium",
            (b"k", b'{"key": "d", "seq": 1}', [("eventType", b"x")]),
            "debezium: no 'id' header with the event id",
        ),
        "json": (
            JSON_BODY,
            (b"k", b'{"data": {}}', []),
            "generic: no event id at /meta/id in the value",
        ),
        # A user's envelope with a bug (it insists on x-schema 2); fixed before the replay.
        "legacy": (
            "tests.support.envelopes:strict",
            (
                b"k",
                b'{"key": "l0", "seq": 0}',
                [("x-msg-id", b"legacy-1"), ("x-kind", b"thing.happened")],
            ),
            "tests.support.envelopes:strict: x-schema is not 2",
        ),
    }


def replay(settings: OutboxSettings, consumer: str) -> str:
    env = subprocess_env(settings)
    done = subprocess.run(
        ["outbox", "dlq", "replay", "--consumer", consumer], env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stderr.decode()


async def test_unreadable_records_are_dead_lettered_with_the_reason_and_replayed(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    cases = unreadable_records()
    topics = {kind: await new_topic() for kind in cases}
    table = effects_table(engine)
    group = name()

    def app(fixed: bool) -> inbox.Consumer:
        envelopes = {topics[kind]: envelope for kind, (envelope, _, _) in cases.items()}
        if fixed:
            envelopes[topics["legacy"]] = "tests.support.envelopes:legacy"
        a = inbox.Consumer(name=group, topics=list(topics.values()), envelopes=envelopes)
        recording(a, table, topics["debezium"])
        return a

    for kind, (_, record, _) in cases.items():
        await asyncio.to_thread(rdkafka_produce, kafka_bootstrap, topics[kind], [record])
    # A readable record after each: the partition moves on past the dead letter.
    await produce(
        kafka_bootstrap,
        topics["debezium"],
        [(b"k", b'{"key": "d", "seq": 2}', [("id", b"dbz-ok")])],
    )
    s = fast_settings(settings)
    async with RunningConsumer(app(fixed=False), s) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 4, what="dead letters")
        await wait_for(lambda: c.metrics.counts["processed"] >= 1, what="the record after")
    letters = DeadLetters(s)
    try:
        dead = {d.topic: d for d in await letters.list(DeadLetterFilter(consumer=group))}
        assert set(dead) == set(topics.values())
        for kind, (_, record, reason) in cases.items():
            letter = dead[topics[kind]]
            assert (letter.error_class, letter.error_message) == ("MalformedRecord", reason)
            assert letter.event_id == f"{topics[kind]}:0:0" and letter.value == record[1]
            dlq = await read_all(kafka_bootstrap, topics[kind] + ".dlq", expect=1)
            assert [r.headers["dlq_error_message"].decode() for r in dlq] == [reason]
            assert dlq[0].value == record[1]  # the record as the producer wrote it

        assert "replayed 4" in replay(s, group)
        # The replayed records are read by the same envelopes (the user's one fixed meanwhile):
        # three are still unreadable and land on their own dead letters again; the fixed one
        # is applied under the producer's id.
        async with RunningConsumer(app(fixed=True), s) as c:
            await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 3, what="again")
            await wait_for(lambda: effect_counts(engine, table).get("legacy-1") == 1)
        again = await letters.list(DeadLetterFilter(consumer=group))
        assert len(again) == 4  # no new dead letters: the replays kept their ids
        for letter in again:
            assert letter.replays == 1
            if letter.topic != topics["legacy"]:
                assert letter.inbox_status == "dead_lettered"
                assert letter.error_message == cases[_kind(topics, letter.topic)][2]

        # Replaying once more cannot apply the fixed event twice.
        replay(s, group)
        async with RunningConsumer(app(fixed=True), s) as c:
            await wait_for(lambda: c.metrics.counts["duplicates"] >= 1, what="the duplicate")
            await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 3, what="again")
        assert effect_counts(engine, table) == {"legacy-1": 1, "dbz-ok": 1}
        assert len(await letters.list(DeadLetterFilter(consumer=group))) == 4
    finally:
        await letters.close()


def _kind(topics: dict[str, str], topic: str) -> str:
    return next(kind for kind, t in topics.items() if t == topic)


async def test_the_lag_gauge_rises_while_stopped_and_falls_to_zero_after_catching_up(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    group = name()
    gate = asyncio.Event()

    def app() -> inbox.Consumer:
        a = inbox.Consumer(name=group, topics=[topic], envelope="position")

        @a.handler(topic=topic)
        async def slow(thing: Thing, session: AsyncSession) -> None:
            await gate.wait()
            await session.execute(
                text(f"INSERT INTO {table} (event_id, key, seq) VALUES ('x', :k, :s)"),
                {"k": thing.key, "s": thing.seq},
            )

        return a

    def batch(start: int, n: int) -> list[Message]:
        return [
            (f"k{i % 5}".encode(), json.dumps({"key": f"k{i % 5}", "seq": i}).encode(), [])
            for i in range(start, start + n)
        ]

    # Small batches: a partition 4 batches behind is paused (not fetched) while gated.
    s = fast_settings(settings, max_batch_records=10)

    def lag(c: RunningConsumer) -> float | None:
        samples = [
            c.metrics.registry.get_sample_value(
                "outbox_inbox_lag_records",
                {"consumer": group, "topic": topic, "partition": str(p)},
            )
            for p in (0, 1)
        ]
        return None if None in samples else sum(x or 0 for x in samples)

    await produce(kafka_bootstrap, topic, batch(0, 10))
    gate.set()
    async with RunningConsumer(app(), s) as c:
        await wait_for(lambda: lag(c) == 0, what="caught up")
    # Stopped: a producer writes 150 records; nothing reads them.
    gate.clear()
    await produce(kafka_bootstrap, topic, batch(10, 150))
    async with RunningConsumer(app(), s) as c:
        try:
            await wait_for(lambda: lag(c) == 150, what="the lag accumulated while stopped")
            # Still not applying (its handler waits): more records raise the lag further,
            # also on a partition paused for backpressure (its end offset asked, not fetched).
            await produce(kafka_bootstrap, topic, batch(160, 100))
            await wait_for(lambda: lag(c) == 250, timeout=30, what="the lag rising")
        finally:
            gate.set()  # a failure above must not leave the consumer stuck in its handler
        await wait_for(lambda: lag(c) == 0, what="the lag falling to 0")
    assert sum(effect_counts(engine, table).values()) == 260


async def test_an_envelope_returning_garbage_stops_the_consumer_with_nothing_committed(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    group = name()
    app = inbox.Consumer(name=group, topics=[topic], envelope="tests.support.envelopes:garbage")

    @app.handler(topic=topic)
    async def never(thing: Thing, session: AsyncSession) -> None:
        raise AssertionError("no event can reach a handler")

    await produce(kafka_bootstrap, topic, [(b"k", b'{"key": "k", "seq": 1}', [])])
    consumer = RunningConsumer(app, fast_settings(settings))
    with pytest.raises(EnvelopeError, match=r"returned dict for .*\[0\]@0, not an inbox"):
        async with consumer:
            assert consumer.task is not None
            await asyncio.wait_for(asyncio.shield(consumer.task), 60)
    assert await committed_offsets(kafka_bootstrap, group) == {}  # read again after a fix

"""Inbox consumer against real PostgreSQL and Kafka, running in this process."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import DeadLetterFilter, DeadLetters, Permanent, Retryable
from outbox.settings import OutboxSettings
from tests.support.inbox import (
    RunningConsumer,
    ce_headers,
    committed_offsets,
    effect_counts,
    effect_rows,
    effects_table,
    fast_settings,
    produce,
    wait_for,
)
from tests.support.kafka import create_topic, read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]


class Thing(BaseModel):
    key: str
    seq: int


def record(i: int, event_id: str | None = None, etype: str = "test.event", **extra: Any):
    eid = event_id or str(uuid.uuid4())
    body = json.dumps({"key": f"k{i % 7}", "seq": i, **extra}).encode()
    return (f"k{i % 7}".encode(), body, ce_headers(eid, etype))


def name() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


def recorder(app: inbox.Consumer, table: str, calls: list[str] | None = None, **kw: Any) -> None:
    @app.handler("test.event", **kw)
    async def handle(event: Thing, session: AsyncSession) -> None:
        if calls is not None:
            calls.append(f"{event.key}:{event.seq}")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": f"{event.key}:{event.seq}", "k": event.key, "s": event.seq},
        )


async def test_same_event_delivered_three_times_has_one_effect(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    recorder(app, table)
    dup = record(1, event_id=str(uuid.uuid4()))
    others = [record(i) for i in range(2, 50)]
    # Twice in one fetch (same partition), once more later on another partition.
    await produce(kafka_bootstrap, topic, [dup, dup, *others], partition=0)
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 49, what="first pass")
        await produce(kafka_bootstrap, topic, [dup], partition=1)
        await wait_for(lambda: c.metrics.counts["duplicates"] >= 2, what="duplicates")
    counts = effect_counts(engine, table)
    assert counts["k1:1"] == 1
    assert len(counts) == 49 and set(counts.values()) == {1}
    assert c.metrics.counts["duplicates"] == 2
    offsets = await committed_offsets(kafka_bootstrap, app.name)
    assert offsets[(topic, 0)] == 50 and offsets[(topic, 1)] == 1


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_records_compressed_with_any_kafka_codec_are_applied(
    codec: str, settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    # Producers in other languages compress with whatever their team chose (Java: often lz4
    # or zstd); a consumer that cannot decompress a batch would stop at its first record.
    topic = await new_topic(partitions=1)
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    recorder(app, table)
    await produce(kafka_bootstrap, topic, [record(i) for i in range(30)], compression_type=codec)
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 30, what=f"{codec} records")
    counts = effect_counts(engine, table)
    assert len(counts) == 30 and set(counts.values()) == {1}


async def test_sync_handler_writes_in_the_inbox_transaction(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])

    @app.handler("test.event")
    def handle(event: Thing, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )
        if event.seq == 3:
            raise Permanent("seq 3 is refused")  # its write must not survive

    await produce(kafka_bootstrap, topic, [record(i) for i in range(1, 6)])
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 4, what="processing")
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 1, what="dead letter")
    assert effect_counts(engine, table) == {"1": 1, "2": 1, "4": 1, "5": 1}
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(
                text(
                    "SELECT status, count(*) FROM outbox_inbox WHERE consumer = :c GROUP BY status"
                ),
                {"c": app.name},
            ).all()
        )
    assert statuses == {"processed": 4, "dead_lettered": 1}


async def test_always_failing_handler_gets_n_attempts_then_dlq_and_partition_moves_on(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    calls: list[str] = []

    @app.handler("test.event", max_attempts=4)
    async def handle(event: Thing, session: AsyncSession) -> None:
        calls.append(f"{event.key}:{event.seq}")
        if event.seq == 5:
            raise Retryable("downstream keeps failing")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )

    records = [record(i) for i in range(1, 11)]
    await produce(kafka_bootstrap, topic, records)
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 9, what="processing")
    assert calls.count("k5:5") == 4
    assert c.metrics.counts["dead_lettered"] == 1
    assert c.metrics.counts["retries"] == 3
    # Order kept: every event before 5 ran before 5's first attempt, every later one after.
    first5, last5 = calls.index("k5:5"), len(calls) - 1 - calls[::-1].index("k5:5")
    assert all(calls.index(f"k{i % 7}:{i}") > last5 for i in range(6, 11))
    assert all(calls.index(f"k{i % 7}:{i}") < first5 for i in range(1, 5))
    assert sorted(map(int, effect_counts(engine, table))) == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    dlq = await read_all(kafka_bootstrap, topic + ".dlq", expect=1)
    assert len(dlq) == 1
    h = dlq[0].headers
    assert dlq[0].value == records[4][1] and dlq[0].key == records[4][0]
    assert h["ce_id"] == records[4][2][0][1]
    assert h["dlq_error_class"] == b"Retryable"
    assert h["dlq_attempts"] == b"4"
    assert h["dlq_consumer"] == app.name.encode()
    assert h["dlq_original_topic"] == topic.encode()
    assert (h["dlq_original_partition"], h["dlq_original_offset"]) == (b"0", b"4")


async def test_invalid_payload_is_dead_lettered_at_once_without_echoing_it(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    calls: list[str] = []
    recorder(app, table, calls)
    secret = "card-4242424242424242"
    bad_model = (
        b"k",
        json.dumps({"key": secret, "seq": "not-a-number"}).encode(),
        ce_headers(str(uuid.uuid4())),
    )
    bad_json = (b"k", b"{not json", ce_headers(str(uuid.uuid4())))
    no_id = (b"k", b"{}", [("ce_type", b"test.event")])
    unknown = (b"k", b"{}", ce_headers(str(uuid.uuid4()), "nobody.handles.this"))
    await produce(kafka_bootstrap, topic, [bad_model, bad_json, no_id, unknown, record(1)])
    s = fast_settings(settings, unknown_type_policy="dead_letter")  # on request only
    async with RunningConsumer(app, s) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 4, what="dead letters")
        await wait_for(lambda: c.metrics.counts["processed"] >= 1, what="good event")
    assert calls == ["k1:1"]  # the handler never ran for the bad ones
    assert c.metrics.counts["retries"] == 0
    dlq = await read_all(kafka_bootstrap, topic + ".dlq", expect=4)
    classes = [r.headers["dlq_error_class"] for r in dlq]
    assert classes == [
        b"ValidationError",
        b"ValidationError",
        b"MalformedRecord",
        b"UnknownEventType",
    ]
    assert [r.headers["dlq_attempts"] for r in dlq] == [b"1", b"1", b"0", b"0"]
    for r in dlq:
        assert secret.encode() not in r.headers["dlq_error_message"]
    assert b"seq" in dlq[0].headers["dlq_error_message"]
    letters = DeadLetters(settings)
    try:
        rows = await letters.list(DeadLetterFilter(consumer=app.name))
    finally:
        await letters.close()
    assert len(rows) == 4
    # A record without ce_id is known by its position.
    assert f"{topic}:0:2" in {r.event_id for r in rows}


async def test_unknown_types_are_skipped_by_default(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    recorder(app, table)
    unknown = (b"k", b"{}", ce_headers(str(uuid.uuid4()), "other.type"))
    await produce(kafka_bootstrap, topic, [unknown, record(1), unknown, record(2)])
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 2, what="processing")
    assert c.metrics.counts["skipped"] == 2 and c.metrics.counts["dead_lettered"] == 0
    assert len(effect_counts(engine, table)) == 2


async def test_two_consumers_in_one_group_racing_on_a_duplicate_apply_it_once(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    import asyncio

    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    started: list[str] = []

    @app.handler("test.event")
    async def slow(event: Thing, session: AsyncSession) -> None:
        started.append(event.key)
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )
        await asyncio.sleep(0.5)  # both members are inside their transactions at once

    s = fast_settings(settings)
    async with RunningConsumer(app, s) as a, RunningConsumer(app, s) as b:
        await wait_for(lambda: a.assigned() and b.assigned(), what="both members assigned")
        dup = record(1, event_id=str(uuid.uuid4()))
        await asyncio.gather(
            produce(kafka_bootstrap, topic, [dup], partition=0),
            produce(kafka_bootstrap, topic, [dup], partition=1),
        )
        total = lambda k: a.metrics.counts[k] + b.metrics.counts[k]  # noqa: E731
        await wait_for(lambda: total("processed") + total("duplicates") >= 2, what="both")
    assert effect_counts(engine, table) == {"1": 1}
    assert total("processed") == 1 and total("duplicates") == 1


async def test_replay_from_dlq_runs_the_handler_once_more(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    broken = {"yes": True}
    calls: list[str] = []

    @app.handler("test.event")
    async def handle(event: Thing, session: AsyncSession) -> None:
        calls.append(str(event.seq))
        if broken["yes"]:
            raise Permanent("bug, fixed later")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )

    eid = str(uuid.uuid4())
    await produce(kafka_bootstrap, topic, [record(7, event_id=eid)])
    letters = DeadLetters(settings)
    try:
        async with RunningConsumer(app, fast_settings(settings)) as c:
            await wait_for(lambda: c.metrics.counts["dead_lettered"] == 1, what="dead letter")
            broken["yes"] = False  # the bug is fixed
            report = await letters.replay(DeadLetterFilter(consumer=app.name, event_id=eid))
            assert len(report.replayed) == 1
            await wait_for(lambda: c.metrics.counts["processed"] == 1, what="replayed")
            # A second replay is refused, and another copy of the event is a duplicate.
            again = await letters.replay(DeadLetterFilter(consumer=app.name, event_id=eid))
            assert len(again.refused) == 1 and not again.replayed
            await produce(kafka_bootstrap, topic, [record(7, event_id=eid)])
            await wait_for(lambda: c.metrics.counts["duplicates"] == 1, what="duplicate")
        [letter] = await letters.list(DeadLetterFilter(consumer=app.name))
        assert letter.inbox_status == "processed" and letter.replays == 1
        assert await letters.purge(DeadLetterFilter(consumer=app.name)) == 1
    finally:
        await letters.close()
    assert effect_counts(engine, table) == {"7": 1}
    assert calls == ["7", "7"]


async def test_serialization_failure_is_retried_not_dead_lettered(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    import psycopg.errors
    from sqlalchemy.exc import OperationalError

    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    failures = {"left": 2}

    @app.handler("test.event")
    async def handle(event: Thing, session: AsyncSession) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise OperationalError("UPDATE", {}, psycopg.errors.SerializationFailure("conflict"))
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )

    await produce(kafka_bootstrap, topic, [record(1)])
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["processed"] == 1, what="processed")
    # Run again at once (a conflict is not the event's fault): no retry, no attempt counted.
    assert c.metrics.counts["retries"] == 0 and c.metrics.counts["dead_lettered"] == 0
    assert effect_counts(engine, table) == {"1": 1}


async def test_one_transaction_per_event_mode(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic(partitions=3)
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    recorder(app, table)
    await produce(kafka_bootstrap, topic, [record(i) for i in range(300)])
    async with RunningConsumer(app, fast_settings(settings, transaction_per="event")) as c:
        await wait_for(lambda: c.metrics.counts["processed"] >= 300, what="processing")
    assert len(effect_counts(engine, table)) == 300


def test_auto_commit_is_refused() -> None:
    with pytest.raises(inbox.HandlerConfigurationError, match="auto_commit"):
        inbox.Consumer(name="x", topics=["t"], kafka_options={"enable_auto_commit": True})


async def test_missing_source_topic_fails_clearly(settings: OutboxSettings) -> None:
    from outbox.errors import TopicMissing

    app = inbox.Consumer(name=name(), topics=[f"missing-{uuid.uuid4().hex[:8]}"])
    with pytest.raises(TopicMissing, match="does not exist"):
        async with RunningConsumer(app, settings):
            pass


async def test_an_unknown_kafka_option_fails_the_start_with_a_typed_error(
    settings: OutboxSettings, new_topic: NewTopic
) -> None:
    from outbox.errors import ConfigurationError

    topic = await new_topic(partitions=1)
    # A librdkafka-style name: the consumer takes aiokafka's keyword arguments.
    app = inbox.Consumer(name=name(), topics=[topic], kafka_options={"fetch.min.bytes": 1})
    with pytest.raises(ConfigurationError, match=r"fetch\.min\.bytes"):
        async with RunningConsumer(app, settings):
            pass


async def test_members_joining_and_leaving_mid_stream_lose_nothing_and_keep_key_order(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    """A second member joins while the first is mid-run (its partitions are revoked with
    batches and shared transactions in flight), then the first leaves mid-stream."""
    import asyncio

    topic = await new_topic(partitions=6)
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])

    @app.handler("test.event")
    async def handle(event: Thing, session: AsyncSession) -> None:
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(event.seq), "k": event.key, "s": event.seq},
        )
        await asyncio.sleep(0.001)  # keeps runs in flight when partitions are revoked

    total = 3000

    async def stream() -> None:
        for start in range(0, total, 100):  # ~3 s of traffic
            await produce(kafka_bootstrap, topic, [record(i) for i in range(start, start + 100)])
            await asyncio.sleep(0.1)

    s = fast_settings(settings)
    first, second = RunningConsumer(app, s), RunningConsumer(app, s)
    await first.__aenter__()
    try:
        await wait_for(first.assigned, what="first member assigned")
        producing = asyncio.create_task(stream())
        await wait_for(lambda: first.metrics.counts["processed"] > 200, what="first batches")
        await second.__aenter__()
        await wait_for(second.assigned, what="second member assigned")
        await wait_for(lambda: second.metrics.counts["processed"] > 100, what="second batches")
    finally:
        await first.__aexit__(None, None, None)  # leaves mid-stream
    try:
        await producing
        await wait_for(lambda: len(effect_counts(engine, table)) >= total, what="all effects")
    finally:
        await second.__aexit__(None, None, None)
    assert first.metrics.counts["processed"] > 0 and second.metrics.counts["processed"] > 0
    counts = effect_counts(engine, table)
    assert set(counts) == {str(i) for i in range(total)}  # none lost
    assert set(counts.values()) == {1}  # none applied twice
    last: dict[str | None, int] = {}
    out_of_order = 0
    for _, key, seq in effect_rows(engine, table):
        assert seq is not None
        out_of_order += seq < last.get(key, -1)
        last[key] = seq
    assert out_of_order == 0


async def test_large_records_pause_fetching_by_bytes_and_all_are_applied(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str
) -> None:
    # 40 records of 1 MB behind a slow handler: the partition's fetching pauses once 4 MiB
    # are waiting (not 2,000 records, 40 MB), and resumes as they are finished.
    topic = await create_topic(kafka_bootstrap, configs={"max.message.bytes": "3000000"})
    table = effects_table(engine)
    app = inbox.Consumer(name=name(), topics=[topic])
    calls: list[str] = []

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        body = event.json()
        # Slow enough that fetching always runs ahead to the limit: at 0.02 s a fast run
        # kept up, never held 4 MiB, and proved nothing about the pause (CI: 4,000,136 B).
        await asyncio.sleep(0.2)
        calls.append(event.event_id)
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": event.event_id, "k": body["key"], "s": body["seq"]},
        )

    pad = "x" * 1_000_000
    big = [
        (b"k", json.dumps({"key": "k", "seq": i, "pad": pad}).encode(), ce_headers(f"big-{i}"))
        for i in range(40)
    ]
    await produce(kafka_bootstrap, topic, big, partition=0, max_request_size=4_000_000)
    limit = 4 * 1024 * 1024
    s = fast_settings(settings, max_fetched_bytes=limit)
    most = 0
    async with RunningConsumer(app, s) as c:

        def done() -> bool:
            nonlocal most
            most = max([most, *(lane.fetched_bytes for lane in c.daemon._lanes.values())])
            return len(calls) >= 40

        await wait_for(done, timeout=120, what="40 large records applied")
    # At most one fetch past the limit (a fetch returns up to one oversized record batch).
    assert limit <= most <= limit + 3_000_000, most
    assert sorted(effect_counts(engine, table)) == sorted(f"big-{i}" for i in range(40))
    assert set(effect_counts(engine, table).values()) == {1}

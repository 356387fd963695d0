"""Short runs of several partitions handled in one shared transaction (inbox/runner.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from sqlalchemy import BigInteger, Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import inbox
import inbox.runner
import inbox.store
from inbox import Retryable
from inbox.event import InboxEvent
from inbox.marker import AttemptMarker
from inbox.processor import PartitionProcessor
from outbox.settings import ConsumerSettings, OutboxSettings, RetrySettings
from tests.support.inbox import (
    RunningConsumer,
    ce_headers,
    effect_counts,
    effects_table,
    fast_settings,
    wait_for,
)

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
PARTITIONS = 4
WAVES = 6


class Thing(BaseModel):
    key: str
    seq: int


async def test_a_failing_handler_in_a_shared_transaction_is_retried_alone_in_its_partition(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = await new_topic(partitions=PARTITIONS)
    table = effects_table(engine)
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])
    calls: list[tuple[int, int]] = []  # (partition, seq) per handler call
    failing = (1, 3 * PARTITIONS + 1)  # partition 1, wave 3: fails on its first attempt

    @app.handler("test.event", max_attempts=3)
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        thing = Thing.model_validate_json(event.value or b"")
        calls.append((event.partition, thing.seq))
        if (event.partition, thing.seq) == failing and calls.count(failing) == 1:
            raise Retryable("first attempt fails")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(thing.seq), "k": thing.key, "s": thing.seq},
        )

    shared: list[set[tuple[int, int]]] = []  # (partition, offset)s per shared transaction
    together = inbox.runner.process_together

    async def spy(members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]]) -> None:
        shared.append({(e.partition, e.offset) for _, run in members for e in run})
        await together(members)

    monkeypatch.setattr(inbox.runner, "process_together", spy)
    fast = settings.model_copy(
        update={
            "retry": RetrySettings(base_seconds=0.01, cap_seconds=0.05),
            "consumer": ConsumerSettings(max_attempts=3),
        }
    )
    async with RunningConsumer(app, fast) as c:
        await wait_for(c.assigned, what="assignment")
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=20)
        await producer.start()
        try:
            for wave in range(WAVES):
                # One record per partition, sent together: they arrive in one fetch.
                sent = []
                for p in range(PARTITIONS):
                    seq = wave * PARTITIONS + p
                    body = json.dumps({"key": f"p{p}", "seq": seq}).encode()
                    headers = ce_headers(str(uuid.uuid4()))
                    sent.append(await producer.send(topic, body, partition=p, headers=headers))
                await asyncio.gather(*sent)
                await asyncio.sleep(0.3)
        finally:
            await producer.stop()
        total = WAVES * PARTITIONS
        await wait_for(lambda: c.metrics.counts["processed"] >= total, what="processing")
    # The failing event (partition 1, offset 3) had its first attempt in a shared one.
    assert any((1, 3) in events and len({p for p, _ in events}) >= 2 for events in shared)
    # Every effect exactly once; the failing event ran twice (its first attempt rolled back).
    assert effect_counts(engine, table) == {str(s): 1 for s in range(total)}
    assert calls.count(failing) == 2
    assert c.metrics.counts["retries"] == 1
    assert c.metrics.counts["dead_lettered"] == 0
    # Each partition's events ran in offset (= seq) order.
    for p in range(PARTITIONS):
        seqs = [s for q, s in calls if q == p]
        assert seqs == sorted(seqs)
    # Every attempt marker is disarmed at the end.
    with engine.connect() as conn:
        armed = conn.execute(
            text(
                f"SELECT count(*) FROM {fast.db_schema}.{fast.table_prefix}inbox_attempts "
                "WHERE consumer = :c AND attempts <> 0"
            ),
            {"c": app.name},
        ).scalar_one()
    assert armed == 0


async def test_a_slow_stream_writes_no_attempt_marker_of_its_own_after_the_first_run(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each commit arms the marker ahead, so runs after the first cost no extra commit."""
    topic = await new_topic(partitions=PARTITIONS)
    table = effects_table(engine)
    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])

    attempts_table = f"{settings.db_schema}.{settings.table_prefix}inbox_attempts"
    uncovered: list[int] = []  # offsets whose handler ran without a durable marker over them

    @app.handler("test.event")
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        with engine.connect() as conn:  # what a crash right now would leave behind
            marker = conn.execute(
                text(
                    f"SELECT start_offset, end_offset, attempts FROM {attempts_table} "
                    "WHERE consumer = :c AND topic = :t AND partition = :p"
                ),
                {"c": app.name, "t": event.topic, "p": event.partition},
            ).one_or_none()
        armed = marker is not None and marker.attempts >= 1
        if not (armed and marker.start_offset <= event.offset <= marker.end_offset):
            uncovered.append(event.offset)
        thing = Thing.model_validate_json(event.value or b"")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": str(thing.seq), "k": thing.key, "s": thing.seq},
        )

    own_writes: list[int] = []  # partitions whose marker was committed on its own
    mark, arm = AttemptMarker.mark, inbox.store.InboxStore.arm_markers

    async def spy_mark(self: AttemptMarker, *args: Any, **kw: Any) -> None:
        own_writes.append(self.partition)
        await mark(self, *args, **kw)

    async def spy_arm(self: Any, db: Any, consumer: str, runs: Any) -> None:
        own_writes.extend(p for _, p, _, _ in runs)
        await arm(self, db, consumer, runs)

    monkeypatch.setattr(AttemptMarker, "mark", spy_mark)
    monkeypatch.setattr(inbox.store.InboxStore, "arm_markers", spy_arm)
    async with RunningConsumer(app, settings) as c:
        await wait_for(c.assigned, what="assignment")
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            for seq in range(WAVES * PARTITIONS):
                body = json.dumps({"key": "k", "seq": seq}).encode()
                headers = ce_headers(str(uuid.uuid4()))
                await producer.send_and_wait(
                    topic, body, partition=seq % PARTITIONS, headers=headers
                )
                await wait_for(lambda seq=seq: c.metrics.counts["processed"] > seq, what="run")
        finally:
            await producer.stop()
    assert len(effect_counts(engine, table)) == WAVES * PARTITIONS
    assert uncovered == []
    # One run at a time, WAVES per partition: only each partition's first wrote on its own.
    assert sorted(own_writes) == list(range(PARTITIONS))
    # A clean stop disarms what was armed ahead (the next owner must not see a crash).
    with engine.connect() as conn:
        armed = conn.execute(
            text(f"SELECT count(*) FROM {attempts_table} WHERE consumer = :c AND attempts <> 0"),
            {"c": app.name},
        ).scalar_one()
    assert armed == 0


async def test_a_write_failing_at_the_shared_flush_is_found_by_running_alone(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure that no handler raised (an ORM write failing at the transaction's final
    flush) cannot be pinned on one event: every partition of the shared transaction runs
    alone again, where the savepoint per event finds it."""
    topic = await new_topic(partitions=PARTITIONS)
    table = effects_table(engine)
    with engine.begin() as conn:  # seq 5 is refused by the database, at flush time only
        conn.execute(text(f"ALTER TABLE {table} ADD CONSTRAINT no_five CHECK (seq <> 5)"))

    class Base(DeclarativeBase):
        pass

    class Effect(Base):
        __tablename__ = table
        id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
        event_id: Mapped[str]
        key: Mapped[str]
        seq: Mapped[int]

    app = inbox.Consumer(name=f"c-{uuid.uuid4().hex[:10]}", topics=[topic])

    @app.handler("test.event", max_attempts=2)
    async def handle(thing: Thing, session: AsyncSession) -> None:
        session.add(Effect(event_id=str(thing.seq), key=thing.key, seq=thing.seq))

    shared: list[int] = []  # members per shared transaction
    together = inbox.runner.process_together

    async def spy(members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]]) -> None:
        shared.append(len(members))
        await together(members)

    monkeypatch.setattr(inbox.runner, "process_together", spy)
    async with RunningConsumer(app, fast_settings(settings, max_attempts=2)) as c:
        await wait_for(c.assigned, what="assignment")
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=20)
        await producer.start()
        try:
            for wave in range(2):  # one per partition, sent together; seq 5 in the second
                sent = []
                for p in range(PARTITIONS):
                    seq = wave * PARTITIONS + p
                    body = json.dumps({"key": f"p{p}", "seq": seq}).encode()
                    headers = ce_headers(str(uuid.uuid4()))
                    sent.append(await producer.send(topic, body, partition=p, headers=headers))
                await asyncio.gather(*sent)
                await wait_for(
                    lambda wave=wave: c.metrics.counts["processed"] >= PARTITIONS * (wave + 1) - 1,
                    timeout=30,
                    what="the wave",
                )
        finally:
            await producer.stop()
        await wait_for(
            lambda: (
                c.metrics.counts["processed"] + c.metrics.counts["dead_lettered"] >= 2 * PARTITIONS
            ),
            timeout=30,
            what="every event handled or dead-lettered",
        )
    assert effect_counts(engine, table) == {str(s): 1 for s in range(2 * PARTITIONS) if s != 5}
    assert c.metrics.counts["dead_lettered"] == 1
    assert any(n >= 2 for n in shared)  # the failing write was in a shared transaction

"""`outbox lag` as a subprocess: its numbers match what the test inserted."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from sqlalchemy import Engine, func, insert, select, update

from outbox import Outbox
from outbox.envelope import Message
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.acceptance.conftest import Cli, SchemaFactory
from tests.support.kafka import create_topic

pytestmark = pytest.mark.acceptance

AGE = 120.0  # seconds the oldest pending row of topic A is backdated by
AGE_TOLERANCE = 60.0  # subprocess start-up and a loaded 2-core machine


def publish(engine: Engine, settings: OutboxSettings, topic: str, n: int, **kw: Any) -> None:
    messages = [
        Message(topic=topic, key=f"k{i}", event_type="test.lag", payload={"i": i}, **kw)
        for i in range(n)
    ]
    with engine.begin() as conn:
        Outbox(settings).publish_many(conn, messages)


def move_to_failed(engine: Engine, settings: OutboxSettings, topic: str, n: int) -> None:
    """What the relay does with a row Kafka rejects: copy to failed, delete from events."""
    t = build_tables(settings)
    e, f = t.events, t.failed
    cols = [c.name for c in f.columns if c.name != "failed_at"]
    with engine.begin() as conn:
        ids = list(
            conn.execute(
                select(e.c.id).where(e.c.topic == topic).order_by(e.c.id).limit(n)
            ).scalars()
        )
        conn.execute(
            insert(f).from_select(cols, select(*(e.c[c] for c in cols)).where(e.c.id.in_(ids)))
        )
        conn.execute(e.delete().where(e.c.id.in_(ids)))


@dataclass(frozen=True)
class Populated:
    cli: Cli
    topic_a: str  # exists in Kafka (3 partitions)
    topic_b: str  # does not exist in Kafka


@pytest.fixture(scope="module")
def populated(fresh_schema: SchemaFactory, acceptance_engine: Engine) -> Populated:
    """keep-mode schema. topic A: 10 events, 4 published, 1 of the rest 120 s old, plus 1
    delayed an hour (pending, not due). topic B: 5 events, 2 moved to failed."""
    s = fresh_schema(keep_published_hours=1)
    engine = acceptance_engine
    topic_a = asyncio.run(create_topic(s.kafka_bootstrap_servers, partitions=3))
    topic_b = f"absent-{uuid.uuid4().hex[:8]}"
    publish(engine, s, topic_a, 10)
    publish(engine, s, topic_a, 1, delay_seconds=3600)
    publish(engine, s, topic_b, 5)
    e = build_tables(s).events
    with engine.begin() as conn:
        ids = list(
            conn.execute(select(e.c.id).where(e.c.topic == topic_a).order_by(e.c.id)).scalars()
        )
        conn.execute(update(e).where(e.c.id.in_(ids[:4])).values(published_at=func.now()))
        backdated = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, AGE)
        conn.execute(
            update(e).where(e.c.id == ids[4]).values(created_at=backdated, available_at=backdated)
        )
    move_to_failed(engine, s, topic_b, 2)
    return Populated(Cli(s), topic_a, topic_b)


def by_topic(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["topic"]: t for t in report["topics"]}


def test_lag_json_matches_what_was_inserted(populated: Populated) -> None:
    report = populated.cli.json("lag", "--no-discover")
    topics = by_topic(report)
    a, b = topics[populated.topic_a], topics[populated.topic_b]

    assert report["mode"] == "keep"
    assert (a["pending"], a["due"], a["failed"]) == (7, 6, 0)
    assert AGE <= a["oldest_pending_age_seconds"] <= AGE + AGE_TOLERANCE
    # keep-mode rate: the 4 rows marked published within the last minute, per second
    assert a["rate_source"] == "db:published_at/60s"
    assert a["publish_rate_per_second"] == pytest.approx(4 / 60)
    assert (a["exists"], a["partitions"]) == (True, 3)

    assert (b["pending"], b["due"], b["failed"]) == (3, 3, 2)
    assert 0 <= b["oldest_pending_age_seconds"] < AGE
    assert b["exists"] is False

    totals = report["totals"]
    assert (totals["pending"], totals["failed"]) == (10, 2)
    assert totals["oldest_pending_age_seconds"] == a["oldest_pending_age_seconds"]
    assert totals["unowned_lanes"] == populated.cli.settings.lanes  # no relay registered
    assert report["breaches"] == []


@pytest.mark.parametrize(
    ("option", "value", "rc"),
    [
        ("--max-age", "60", 3),  # oldest due row is >= 120 s old
        ("--max-age", "3600", 0),  # the hour-delayed row is not due, so it does not count
        ("--max-pending", "9", 3),  # 10 pending
        ("--max-pending", "10", 0),
    ],
)
def test_lag_thresholds_set_the_exit_code(
    populated: Populated, option: str, value: str, rc: int
) -> None:
    report = populated.cli.json("lag", "--no-kafka", option, value, expect_rc=rc)
    assert bool(report["breaches"]) == (rc == 3)


def test_lag_threshold_in_human_mode_says_why(populated: Populated) -> None:
    proc = populated.cli("lag", "--no-kafka", "--max-age", "60", "--max-pending", "100")
    assert proc.returncode == 3, proc.stderr
    assert "error: ThresholdExceeded: " in proc.stderr
    assert "oldest pending event" in proc.stderr
    assert populated.topic_a in proc.stdout


async def _produce(bootstrap: str, topic: str, counts: dict[int, int]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for partition, n in counts.items():
            for i in range(n):
                await producer.send(topic, f"v{i}".encode(), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


async def _commit(bootstrap: str, group: str, offsets: dict[TopicPartition, int]) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit(offsets)
    finally:
        await consumer.stop()


async def test_lag_reports_consumer_group_lag_and_dead_letters(
    fresh_schema: SchemaFactory,
    acceptance_engine: Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., Awaitable[str]],
) -> None:
    s = fresh_schema()
    topic = await new_topic(partitions=2)
    group, discovered = f"g-{uuid.uuid4().hex[:8]}", f"d-{uuid.uuid4().hex[:8]}"
    await _produce(kafka_bootstrap, topic, {0: 10, 1: 4})
    await _commit(kafka_bootstrap, group, {TopicPartition(topic, 0): 4})  # p1 never committed
    t = build_tables(s)
    with acceptance_engine.begin() as conn:
        conn.execute(
            insert(t.dead_letters).values(
                consumer=group, event_id=str(uuid.uuid4()), topic=topic, partition=0, offset=2,
                header_names=[], header_values=[], error_class="ValueError",
                error_message="bad", attempts=5, dlq_topic=f"{topic}.dlq",
            )
        )  # fmt: skip
        conn.execute(
            insert(t.inbox).values(
                consumer=discovered, event_id="e1", topic=topic, partition=1, offset=0,
                status="processed", processed_at=func.now(),
            )
        )  # fmt: skip

    report = Cli(s).json("lag", "--group", group)
    groups = {g["group"]: g for g in report["groups"]}
    g = groups[group]
    parts = {p["partition"]: p for p in g["partitions"]}
    assert (parts[0]["end_offset"], parts[0]["committed"], parts[0]["lag"]) == (10, 4, 6)
    assert (parts[1]["end_offset"], parts[1]["committed"], parts[1]["lag"]) == (4, None, 4)
    assert g["total_lag"] == 10
    assert (g["dead_letters"], g["dead_letters_not_replayed"], g["dead_letters_last_hour"]) == (
        1,
        1,
        1,
    )
    # a consumer known only from the inbox table is discovered; it never committed
    assert groups[discovered]["partitions"] == [] and groups[discovered]["error"] is None

    over = Cli(s).json("lag", "--group", group, "--max-consumer-lag", "9", expect_rc=3)
    assert any(group in b for b in over["breaches"])


def test_lag_watch_refreshes_and_stops_cleanly_on_sigterm(
    populated: Populated, tmp_path: Path
) -> None:
    log = tmp_path / "watch.out"
    proc = populated.cli.popen(
        "lag", "--watch", "--json", "--no-kafka", "--interval", "0.3", log=log
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and log.read_text().count("\n") < 3:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    frames = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(frames) >= 3
    assert all(f["totals"]["pending"] == 10 for f in frames)

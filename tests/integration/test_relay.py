"""Relay end to end against real PostgreSQL and Kafka (relay in-process here; crash and
CLI tests run it as a subprocess)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox import Outbox
from outbox.errors import TopicMissing
from outbox.settings import OutboxSettings, StatusSettings
from outbox.tables import build_tables
from relay import Relay
from relay.errors import PartitionUnavailable
from relay.event import ID, LANE
from relay.sources.table.cursor import LANE_START
from relay.sources.table.store import ClaimStore
from tests.support.inbox import wait_for
from tests.support.kafka import read_all
from tests.support.relay import fast, publish_numbered, read_ids, verdict

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    # A relay publishes every pending row of its tables: give each test tables of its own.
    return isolated_settings


async def test_committed_events_arrive_rolled_back_never(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    topic = await new_topic(partitions=3)
    ids = publish_numbered(engine, settings, topic, 500, keys=20)
    ob = Outbox(settings)
    with engine.connect() as conn:
        tx = conn.begin()
        ghost = ob.publish(
            conn, topic=topic, key="k1", event_type="test.ghost", payload={"key": "k1", "seq": -1}
        )
        tx.rollback()
    await running(fast(settings))
    records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert str(ghost) not in {r.headers["ce_id"].decode() for r in records}
    one = records[0]
    assert {"ce_id", "ce_type", "ce_source", "ce_time", "ce_specversion", "content-type"} <= set(
        one.headers
    )
    assert one.headers["ce_specversion"] == b"1.0"
    assert one.headers["content-type"] == b"application/json"
    assert one.headers["ce_type"] == b"test.numbered"


async def test_lower_id_committing_after_higher_id_is_published(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    topic = await new_topic()
    ob = Outbox(settings)
    await running(fast(settings))
    with engine.connect() as slow:
        tx = slow.begin()
        low = ob.publish(slow, topic=topic, key="k", event_type="t", payload={"key": "k", "seq": 0})
        with engine.begin() as quick:
            high = ob.publish(
                quick, topic=topic, key="k", event_type="t", payload={"key": "k", "seq": 1}
            )
        first = await read_all(settings.kafka_bootstrap_servers, topic, expect=1, wait_seconds=20)
        assert [r.headers["ce_id"].decode() for r in first] == [str(high)]
        await asyncio.sleep(1.0)  # several relay polls pass while the lower id is invisible
        tx.commit()
    both = await read_all(settings.kafka_bootstrap_servers, topic, expect=2, wait_seconds=20)
    assert [r.headers["ce_id"].decode() for r in both] == [str(high), str(low)]
    # Kafka has both records; the relay deletes the rows when its transaction commits,
    # just after the acks arrive.
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        with engine.connect() as conn:
            ids = conn.execute(
                text(f"SELECT id FROM {ob.tables.events.fullname} WHERE event_id IN (:a, :b)"),
                {"a": low, "b": high},
            ).all()
        if not ids or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    assert ids == []  # both deleted once acked


async def test_database_connections_killed_mid_run_lose_nothing(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    topic = await new_topic(partitions=4)
    await running(fast(settings, batch_size=200))
    ids: list[str] = []
    kills = 0
    for round_ in range(10):
        ids += await asyncio.to_thread(
            publish_numbered, engine, settings, topic, 1000, keys=40, start=round_ * 1000
        )
        with engine.connect() as conn:
            kills += len(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'outbox-relay%'"
                        " AND datname = current_database()"
                    )
                ).all()
            )
        await asyncio.sleep(0.2)
    records = await read_ids(settings.kafka_bootstrap_servers, topic, ids)
    v = verdict(records, ids)
    assert kills > 0
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v


async def test_oversize_goes_to_failed_and_a_missing_topic_waits_without_blocking_the_lane(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    from relay import list_failed, purge_failed

    topic = await new_topic()
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    ob = Outbox(settings)
    big_id = uuid.uuid4()
    events = ob.tables.events.fullname
    with engine.begin() as conn:
        before = ob.publish(
            conn, topic=topic, key="same", event_type="t", payload={"key": "same", "seq": 0}
        )
        # Bypass publish()'s own size check: a row written by an older version or by hand.
        conn.execute(
            text(
                f"INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
                " content_type, payload, fingerprint)"
                " SELECT :eid, topic, key, lane, 't.big', source, content_type, :payload,"
                f" fingerprint FROM {events} WHERE event_id = :before"
            ),
            {"eid": big_id, "payload": b"x" * (2 * 1024 * 1024), "before": before},
        )
        lost_topic = ob.publish(conn, topic=missing, key="same", event_type="t", payload={})
        after = ob.publish(
            conn, topic=topic, key="same", event_type="t", payload={"key": "same", "seq": 2}
        )
    relay = await running(fast(settings, max_attempts=2))
    records = await read_all(settings.kafka_bootstrap_servers, topic, expect=2, wait_seconds=20)
    assert [r.headers["ce_id"].decode() for r in records] == [str(before), str(after)]
    deadline = asyncio.get_running_loop().time() + 20
    while not (rows := list_failed(settings)[0]):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.2)
    [big] = rows  # only the record Kafka can never take
    assert (big.event_id, big.attempts) == (str(big_id), 2)
    assert "bytes" in (big.last_error or "")
    assert relay.metrics.failed._value.get() == 1
    # The row for the missing topic waits in the outbox, no attempt counted (a deployment
    # state, not the row's fault) ...
    with engine.connect() as conn:
        waiting = conn.execute(
            text(f"SELECT attempts, last_error FROM {events} WHERE event_id = :e"),
            {"e": lost_topic},
        ).one()
    assert waiting[0] == 0 and missing in (waiting[1] or "")
    # ... and is published once the operator creates the topic, with no retry command.
    await new_topic(name=missing)
    late = await read_all(settings.kafka_bootstrap_servers, missing, expect=1, wait_seconds=20)
    assert [r.headers["ce_id"].decode() for r in late] == [str(lost_topic)]
    assert purge_failed(settings, None) == [big.id]
    assert list_failed(settings) == ([], 0)


async def test_rows_that_waited_for_their_topic_go_out_before_later_rows_of_their_key(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    # Rows for a topic that does not exist yet go back for a few seconds. The operator
    # creates it, and rows of the same key keep being committed: a claim that finds the
    # topic before the early rows are due again must not send the later ones first.
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    ob = Outbox(settings)
    events = ob.tables.events.fullname

    def publish(seqs: range) -> list[str]:
        with engine.begin() as conn:
            return [
                str(ob.publish(conn, topic=missing, key="k", event_type="t", payload={"seq": n}))
                for n in seqs
            ]

    def put_back() -> bool:
        with engine.connect() as conn:
            waiting = conn.execute(
                text(f"SELECT count(*) FROM {events} WHERE last_error LIKE :e"),
                {"e": f"%{missing}%does not exist%"},
            ).scalar_one()
        return bool(waiting == 3)

    early = publish(range(3))
    await running(fast(settings))
    await wait_for(put_back, timeout=20, what="the rows put back for the missing topic")
    await new_topic(name=missing, partitions=2)
    later = publish(range(3, 6))
    records = await read_all(settings.kafka_bootstrap_servers, missing, expect=6, wait_seconds=30)
    assert [r.headers["ce_id"].decode() for r in records] == early + later


async def test_keep_published_marks_rows_instead_of_deleting(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    s = settings.model_copy(update={"table_prefix": f"keep{uuid.uuid4().hex[:6]}_"})
    from outbox import migrate

    migrate.upgrade(s)
    topic = await new_topic(partitions=2)
    ids = publish_numbered(engine, s, topic, 300, keys=10)
    await running(fast(s, keep_published_hours=1))
    records = await read_ids(s.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order) == (0, 0), v
    table = f"{s.table_prefix}events"
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        with engine.connect() as conn:
            marked, total = conn.execute(
                text(f'SELECT count(published_at), count(*) FROM "{table}"')
            ).one()
        if marked == 300 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    assert (marked, total) == (300, 300)


async def test_broker_rejecting_a_record_fails_only_that_row(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """With max_payload_bytes raised above the broker's limit the relay sends the 2 MiB
    record; Kafka rejects it (MessageSizeTooLarge) and the partition's later batches fail
    on the sequence gap. Only the big row may burn attempts; everything else arrives."""
    from relay import list_failed, purge_failed

    s = settings.model_copy(
        update={"table_prefix": f"big{uuid.uuid4().hex[:6]}_", "max_payload_bytes": 4 << 20}
    )
    from outbox import migrate

    migrate.upgrade(s)
    topic = await new_topic(partitions=1)
    ob = Outbox(s)
    before = publish_numbered(engine, s, topic, 200, keys=5)
    with engine.begin() as conn:
        big = ob.publish(conn, topic=topic, key="k1", event_type="t.big", payload=b"x" * (2 << 20))
    after = publish_numbered(engine, s, topic, 200, keys=5, start=200)
    await running(fast(s, max_attempts=3))
    records = await read_ids(s.kafka_bootstrap_servers, topic, before + after, wait_seconds=30)
    v = verdict(records, before + after)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    deadline = asyncio.get_running_loop().time() + 20
    while not (rows := list_failed(s)[0]):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.2)
    assert [r.event_id for r in rows] == [str(big)]
    assert rows[0].attempts == 3 and "MessageSizeTooLarge" in (rows[0].last_error or "")
    with engine.connect() as conn:
        burned = conn.execute(
            text(f'SELECT count(*) FROM "{s.table_prefix}events" WHERE attempts > 0')
        ).scalar_one()
    assert burned == 0
    purge_failed(s, None)


async def test_the_relay_logs_a_status_line_while_it_runs(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = await new_topic()
    ids = publish_numbered(engine, settings, topic, 50, keys=5)
    caplog.set_level("INFO", logger="relay")
    status = StatusSettings(interval_seconds=0.5)
    await running(fast(settings).model_copy(update={"status": status}))
    await read_ids(settings.kafka_bootstrap_servers, topic, ids, wait_seconds=30)

    def published() -> list[float]:
        return [
            getattr(r, "published", -1.0)
            for r in caplog.records
            if r.getMessage() == "relay status"
        ]

    await wait_for(lambda: 50 in published(), timeout=10, what="a status line with 50 published")
    line = next(r for r in caplog.records if r.getMessage() == "relay status")
    assert {"pending", "oldest_age_seconds", "owned_lanes", "kafka_up"} <= set(vars(line))
    assert all(type(getattr(line, name)) is int for name in ("published", "pending", "kafka_up"))


@pytest.mark.parametrize("keep_hours", [0, 24], ids=["delete", "keep"])
def test_a_claim_stops_at_its_byte_budget_keeping_each_lane_a_prefix(
    engine: Engine, settings: OutboxSettings, keep_hours: float
) -> None:
    # Ids in commit order: lane 0 gets 400-byte rows, lane 1 300-byte rows, interleaved.
    s = settings.model_copy(
        update={"relay": settings.relay.model_copy(update={"keep_published_hours": keep_hours})}
    )
    store, events = ClaimStore.of(s), build_tables(s).events
    lanes_and_sizes = [(0, 400), (1, 300), (0, 400), (1, 300), (0, 400)]
    with engine.begin() as conn:
        ids = [
            conn.execute(
                text(
                    f"INSERT INTO {events.fullname} (event_id, topic, key, lane, event_type,"
                    " source, content_type, payload, fingerprint) VALUES (gen_random_uuid(),"
                    " 't', 'k', :lane, 'x', 's', 'application/octet-stream', :payload, '\\x00')"
                    " RETURNING id"
                ),
                {"lane": lane, "payload": b"x" * size},
            ).scalar_one()
            for lane, size in lanes_and_sizes
        ]

    def claim(max_bytes: int) -> list[tuple[int, int]]:
        with psycopg.connect(s.libpq_dsn) as conn:  # rolled back on leaving: nothing claimed
            cur = conn.cursor(binary=True)
            cur.execute(store.fence, {"lanes": [1, 0]})
            cur.execute(
                store.claim,
                {"lanes": [1, 0], "after": [LANE_START] * 2, "limit": 100, "max_bytes": max_bytes},
            )
            rows = sorted(cur.fetchall(), key=lambda r: r[ID])
            conn.rollback()
        return [(r[ID], r[LANE]) for r in rows]

    # Payload bytes before each row, in id order: 0, 400, 700, 1000, 1300.
    assert claim(1_000) == [(ids[0], 0), (ids[1], 1), (ids[2], 0)]
    assert claim(1) == [(ids[0], 0)]  # always at least one row
    assert claim(1 << 20) == list(zip(ids, [0, 1, 0, 1, 0], strict=True))


@pytest.mark.parametrize("held_for", ["a sick partition", "a missing topic"])
async def test_a_lane_taken_over_publishes_rows_held_back_first(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    held_for: str,
) -> None:
    # What a relay that died (or gave the lane up) during a broker failure, or before its
    # topic was created, leaves behind: the row it put back, due only later. The next owner
    # must not pass over it and send the key's later row first; a row the application
    # scheduled for later keeps its time.
    topic = await new_topic(partitions=2)
    why = (
        f"{PartitionUnavailable.MARKER}{topic}[0], leader 2"
        if held_for == "a sick partition"
        else str(TopicMissing(topic))
    )
    held, later = publish_numbered(engine, settings, topic, 2, keys=1)
    with engine.begin() as conn:
        scheduled = str(
            Outbox(settings).publish(conn, topic=topic, key="k1", event_type="t", payload={})
        )
    events = build_tables(settings).events.fullname
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE {events} SET available_at = now() + interval '60 seconds',"
                " last_error = :marker WHERE event_id = :id"
            ),
            {"marker": why, "id": held},
        )
        conn.execute(
            text(
                f"UPDATE {events} SET available_at = now() + interval '1 hour' WHERE event_id = :id"
            ),
            {"id": scheduled},
        )
    await running(fast(settings))
    records = await read_ids(settings.kafka_bootstrap_servers, topic, [held, later], 30)
    order = [r.headers["ce_id"].decode() for r in records]
    assert order[:2] == [held, later], order

    def left() -> list[str]:
        with engine.connect() as conn:
            return list(conn.execute(text(f"SELECT event_id::text FROM {events}")).scalars())

    # Kafka has the records a moment before the relay commits their acknowledgement.
    await wait_for(lambda: left() == [scheduled], 10, "the published rows to leave the outbox")

"""The relay while a long transaction holds a snapshot (issue: claims must not walk every
dead row of their lane), against real PostgreSQL and Kafka, relays in-process.

The snapshot is a second connection in REPEATABLE READ holding an xid, as a report or an
idle session would: VACUUM can remove nothing the relay deletes or marks meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox import Outbox, migrate
from outbox.db import sync_engine
from outbox.envelope import Message, lane_for
from outbox.settings import OutboxSettings
from relay import Relay
from tests.support.inbox import wait_for
from tests.support.kafka import read_all
from tests.support.relay import fast, publish_numbered, read_ids, verdict, wait_drained

pytestmark = pytest.mark.integration

DEAD_ROWS = 24_000
LANES = 16


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    return isolated_settings.model_copy(update={"lanes": LANES})


@contextmanager
def held_snapshot(settings: OutboxSettings) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A second connection in REPEATABLE READ holding an xid, until the block ends."""
    with psycopg.connect(settings.libpq_dsn, application_name="test-held-snapshot") as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT txid_current()")
        try:
            yield conn
        finally:
            conn.rollback()


def wait_published(settings: OutboxSettings, timeout: float) -> None:
    """Until nothing is pending, asking on connections that close (a backend flushes its
    statistics when it exits, but an idle one only every 10 s: its reads of the claim index
    must not land in a later measurement)."""
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(settings.libpq_dsn) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {events} WHERE published_at IS NULL"
            ).fetchone()
        if row == (0,):
            return
        assert time.monotonic() < deadline, f"{row} rows still pending"
        time.sleep(0.2)


def index_reads(settings: OutboxSettings) -> dict[str, tuple[int, int]]:
    """Per outbox index ("claim_idx", "pkey", ...): (scans, entries read), as PostgreSQL
    counted them, once the counts of earlier work have arrived: backends flush their
    statistics at most once a second, later under load. Settled = under 1,000 entries read
    in each of two 1.5 s intervals in a row (an idle relay reads none); after 30 s,
    whatever it is."""
    prefix = f"{settings.table_prefix}events_"

    def read() -> dict[str, tuple[int, int]]:
        with psycopg.connect(settings.libpq_dsn) as conn:
            rows = conn.execute(
                "SELECT indexrelname, idx_scan, idx_tup_read FROM pg_stat_user_indexes"
                " WHERE schemaname = %s AND relname = %s",
                (settings.db_schema, f"{settings.table_prefix}events"),
            ).fetchall()
        return {str(name).removeprefix(prefix): (int(n), int(r)) for name, n, r in rows}

    def total(reads: dict[str, tuple[int, int]]) -> int:
        return sum(r for _, r in reads.values())

    deadline = time.monotonic() + 30
    last, quiet = read(), 0
    while True:
        time.sleep(1.5)
        now = read()
        quiet = quiet + 1 if total(now) - total(last) < 1000 else 0
        if quiet == 2 or time.monotonic() > deadline:
            return now
        last = now


@pytest.mark.parametrize("mode", ["delete", "keep"])
async def test_claims_read_a_bounded_number_of_index_entries_while_a_snapshot_is_held(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    mode: str,
) -> None:
    s = fast(settings, keep_published_hours=1 if mode == "keep" else 0)
    topic = await new_topic(partitions=4)
    await running(s)
    with held_snapshot(s):
        backlog = await asyncio.to_thread(
            publish_numbered, engine, s, topic, DEAD_ROWS, keys=200, per_tx=1000
        )
        # All published: the rows' claim-index entries are dead, and none can be vacuumed.
        await asyncio.to_thread(wait_published, s, 90)
        before = await asyncio.to_thread(index_reads, s)
        # A trickle: every claim now has live rows to take, dead ones to skip.
        trickle: list[str] = []
        for n in range(30):
            trickle += await asyncio.to_thread(
                publish_numbered,
                engine,
                s,
                topic,
                10,
                keys=200,
                per_tx=10,
                start=DEAD_ROWS + n * 10,
            )
            await asyncio.sleep(0.1)
        records = await read_ids(s.kafka_bootstrap_servers, topic, backlog + trickle)
        after = await asyncio.to_thread(index_reads, s)
    v = verdict(records, backlog + trickle)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    scans, read = (a - b for a, b in zip(after["claim_idx"], before["claim_idx"], strict=True))
    pkey = after["pkey"][1] - before["pkey"][1]
    print(f"{mode}: {scans} claim-index scans read {read} entries, the primary key {pkey}")
    assert scans > 100  # the relay kept claiming (and polling) all along
    # Each lane scan starts at the lane's cursor: a few entries, where a scan from the start
    # of the lane walks its share of the dead rows (DEAD_ROWS / LANES = 1,500 here).
    assert read / scans < 10, (scans, read)
    # Claimed rows are deleted (marked) by primary-key probes, never by a join that walks
    # the whole key: a few entries per trickled row, where one merge join reads all 24,000.
    assert pkey < 10 * len(trickle), pkey


def _msg(topic: str, key: str, seq: int) -> Message:
    return Message(topic=topic, key=key, event_type="t", payload={"key": key, "seq": seq})


async def test_a_late_commit_is_published_between_its_neighbours_while_a_snapshot_is_held(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """A producer transaction takes its id, stays open across many claims while rows of
    its key commit after it (higher ids) and the relay publishes other traffic, then
    commits. It is published after its key's rows committed before it (whatever their
    ids) and before those committed after it."""
    s = fast(settings)
    topic = await new_topic(partitions=2)
    ob = Outbox(s)
    lane = lane_for(b"k", uuid.uuid4(), LANES)
    relay = await running(s)
    with held_snapshot(s), engine.connect() as slow:
        with engine.begin() as conn:
            [first] = ob.publish_many(conn, [_msg(topic, "k", 0)])
        slow_tx = slow.begin()
        [late] = ob.publish_many(slow, [_msg(topic, "k", 1)])
        late_id = int(
            slow.execute(
                text(f"SELECT id FROM {ob.tables.events.fullname} WHERE event_id = :e"),
                {"e": late},
            ).scalar_one()
        )
        with engine.begin() as conn:
            [overtaking] = ob.publish_many(conn, [_msg(topic, "k", 2)])
        # Other traffic in many lanes (and in k's) while the late one is open: thousands of
        # claims and dead rows, cursors moving wherever they can.
        others = await asyncio.to_thread(publish_numbered, engine, s, topic, 3000, keys=100)
        early = await read_ids(s.kafka_bootstrap_servers, topic, [str(first), str(overtaking)])
        assert [r.headers["ce_id"].decode() for r in early if r.key == b"k"] == [
            str(first),
            str(overtaking),
        ]
        await asyncio.sleep(1.0)
        # The horizon waits for the open writer, so k's lane cursor stays below its id.
        assert relay.source.cursors.known().get(lane, late_id - 1) < late_id
        slow_tx.commit()
        with engine.begin() as conn:
            [after] = ob.publish_many(conn, [_msg(topic, "k", 3)])
        expected = [str(first), str(overtaking), str(late), str(after)]
        records = await read_ids(s.kafka_bootstrap_servers, topic, expected + others)
        await wait_for(
            lambda: relay.source.cursors.known().get(lane, 0) > late_id,
            timeout=10,
            what="k's lane cursor past the late row once it was published",
        )
    assert [r.headers["ce_id"].decode() for r in records if r.key == b"k"] == expected
    v = verdict([r for r in records if r.key != b"k"], others)
    assert (v.lost, v.out_of_order) == (0, 0), v


async def test_claims_cut_short_by_the_byte_budget_skip_nothing_while_a_snapshot_is_held(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """Rows of ~60 KB against a 1 MiB in-flight budget: every claim stops at its byte share,
    in the middle of a lane, while a snapshot is held and the lane cursors move. A cursor
    must rest on the last row its claim took, not on what the scan passed: every row
    arrives, in commit order per key, a late commit between its key's neighbours."""
    s = fast(settings, max_inflight_bytes=1024 * 1024)
    topic = await new_topic(partitions=2)
    ob = Outbox(s)
    pad = "x" * 60_000

    def big(key: str, seq: int) -> Message:
        # seq follows commit order (the late row gets its seq for when it commits).
        return Message(
            topic=topic, key=key, event_type="t", payload={"key": key, "seq": seq, "pad": pad}
        )

    keys = ["k", "a", "b", "c"]
    ids: list[str] = []
    with held_snapshot(s), engine.connect() as slow:
        with engine.begin() as conn:
            ids += map(str, ob.publish_many(conn, [big("k", 0)]))
        slow_tx = slow.begin()
        [late] = ob.publish_many(slow, [big("k", 1000)])
        for n in range(1, 31):  # a backlog of 120 rows, ~7 MB
            with engine.begin() as conn:
                ids += map(str, ob.publish_many(conn, [big(key, n) for key in keys]))
        relay = await running(s)
        await asyncio.sleep(1.0)
        slow_tx.commit()
        with engine.begin() as conn:
            ids += [str(late), *map(str, ob.publish_many(conn, [big("k", 2000)]))]
        records = await read_ids(s.kafka_bootstrap_servers, topic, ids)
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order) == (0, 0), v
    assert [r.headers["ce_id"].decode() for r in records if r.key == b"k"][-2:] == ids[-2:]
    # The budget did cut the claims: one claim could have taken the whole backlog.
    claims = relay.metrics.registry.get_sample_value("outbox_relay_batch_size_count")
    assert claims is not None and claims >= 7, claims


async def test_delayed_and_put_back_rows_are_not_skipped_while_a_snapshot_is_held(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """A row the producer scheduled (available_at ahead) and a row the relay put back (its
    topic is missing: back with a delay, no attempt counted) sit in lanes whose other rows
    keep flowing past them; both are published once due."""
    s = fast(settings)
    topic = await new_topic(partitions=2)
    missing = f"later-{uuid.uuid4().hex[:8]}"  # the relay puts its row back every 5 s
    ob = Outbox(s)
    await running(s)
    with held_snapshot(s):
        with engine.begin() as conn:
            [scheduled] = ob.publish_many(
                conn,
                [
                    Message(
                        topic=topic,
                        key="k7",
                        event_type="t",
                        payload={"key": "k7", "seq": -1},
                        delay_seconds=4,
                    )
                ],
            )
            [parked] = ob.publish_many(conn, [_msg(missing, "k7", 0)])
        flowing = await asyncio.to_thread(publish_numbered, engine, s, topic, 4000, keys=40)
        records = await read_ids(s.kafka_bootstrap_servers, topic, flowing)
        late = await read_ids(s.kafka_bootstrap_servers, topic, [str(scheduled)], wait_seconds=30)
        assert str(scheduled) in {r.headers["ce_id"].decode() for r in late}
        more = await asyncio.to_thread(
            publish_numbered, engine, s, topic, 2000, keys=40, start=4000
        )
        await read_ids(s.kafka_bootstrap_servers, topic, more)
        await new_topic(name=missing)
        back = await read_all(s.kafka_bootstrap_servers, missing, expect=1, wait_seconds=30)
    assert [r.headers["ce_id"].decode() for r in back] == [str(parked)]
    v = verdict([r for r in records if r.headers["ce_id"].decode() in set(flowing)], flowing)
    assert (v.lost, v.out_of_order) == (0, 0), v


async def test_two_relays_with_a_held_snapshot_keep_per_key_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """Lanes move between two relays while a snapshot is held: a second relay joins (the
    first gives lanes up while its pipelines claim), the first relay's lock connection is
    killed while its claim connections live (both believe they own its lanes until it
    notices), and claim connections are killed mid-batch. Nothing lost, nothing out of
    order per key."""
    s = fast(settings, batch_size=200)
    topic = await new_topic(partitions=4)
    ids: list[str] = []
    done = threading.Event()

    def produce() -> None:
        for chunk in range(60):
            ids.extend(publish_numbered(engine, s, topic, 250, keys=60, start=chunk * 250))
            time.sleep(0.05)
        done.set()

    with held_snapshot(s):
        first = await running(s)
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.sleep(1.5)
        second = await running(s)
        await wait_for(
            lambda: bool(second.source.lanes.owned) and len(first.source.lanes.owned) < LANES,
            timeout=20,
            what="the lanes shared by two relays",
        )
        await asyncio.sleep(0.5)
        with psycopg.connect(s.libpq_dsn, autocommit=True) as admin:
            conn = first.source.lanes._conn
            assert conn is not None
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            await asyncio.sleep(1.0)
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name LIKE 'outbox-relay-%%' AND datname = current_database()"
                " AND application_name NOT LIKE 'outbox-relay-lanes %%'"
            )
        await asyncio.to_thread(done.wait, 60)
        producer.join()
        assert await asyncio.to_thread(wait_drained, engine, s, 60) == 0
        records = await read_ids(s.kafka_bootstrap_servers, topic, ids)
    v = verdict(records, ids)
    assert len(ids) == 15_000
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    # Cursors were in use (not a run that scanned from the lane start all along).
    assert first.source.cursors.known() or second.source.cursors.known()


def test_the_horizon_rests_on_the_lock_an_insert_takes_before_its_id(
    settings: OutboxSettings,
) -> None:
    """The premise of relay/sources/table/cursor.py, checked against this PostgreSQL: an INSERT with
    a cached plan holds RowExclusiveLock on the outbox before it takes an id (here: while a
    subquery it runs first sleeps), and a read-only snapshot holds no such lock."""
    migrate.upgrade(settings)
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    insert = (
        f"INSERT INTO {events} (event_id, topic, lane, event_type, source, content_type,"
        " payload, fingerprint) SELECT gen_random_uuid(), 't', 0, 'e', 's', 'c', '', ''"
        " FROM (SELECT pg_sleep(%s)) s"
    )
    from relay.sources.table.store import ClaimStore

    store = ClaimStore.of(settings)
    with (
        psycopg.connect(settings.libpq_dsn) as writer,
        psycopg.connect(settings.libpq_dsn, autocommit=True) as watcher,
        held_snapshot(settings),
    ):
        for _ in range(6):  # past psycopg's prepare threshold: a cached plan
            writer.execute(insert, (0,), prepare=True)
            writer.commit()

        def reading() -> tuple[int, set[str]]:
            row = watcher.execute(store.last_id).fetchone()
            assert row is not None and row[1] is True
            return int(row[0]), {str(r[0]) for r in watcher.execute(store.writers).fetchall()}

        before, nobody = reading()
        assert nobody == set()  # the held snapshot is not a writer
        worker = threading.Thread(target=lambda: writer.execute(insert, (1.5,), prepare=True))
        worker.start()
        time.sleep(0.7)
        during, writers = reading()
        worker.join()
        after, still = reading()
        writer.rollback()
        _, gone = reading()
    assert during == before and len(writers) == 1  # locked, no id taken yet
    assert after == before + 1 and still == writers  # the id, under the same lock
    assert gone == set()


def test_relay_claim_transactions_do_not_hold_the_horizon(settings: OutboxSettings) -> None:
    """A transaction holding a claim fence (a relay's claim: it never takes an id) is not
    a writer the horizon waits for; any other holder of RowExclusiveLock is."""
    from relay.sources.table.store import ClaimStore
    from relay.store import namespaces

    migrate.upgrade(settings)
    store = ClaimStore.of(settings)
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    with (
        psycopg.connect(settings.libpq_dsn) as claim,
        psycopg.connect(settings.libpq_dsn) as other,
        psycopg.connect(settings.libpq_dsn, autocommit=True) as watcher,
    ):
        claim.execute(
            "SELECT pg_try_advisory_xact_lock(%s, 3)",
            (namespaces(settings.db_schema, settings.table_prefix)[2],),
        )
        claim.execute(f"DELETE FROM {events} WHERE false")
        other.execute(f"DELETE FROM {events} WHERE false")
        pids = [int(r[1]) for r in watcher.execute(store.writers).fetchall()]
        assert pids == [other.info.backend_pid]


async def test_a_row_written_below_a_cursor_outside_the_rules_is_still_published(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The safety net: a row inserted by hand with an old id (as a tool restoring rows
    might) lands below its lane's cursor; the periodic look below the cursors finds it,
    forgets that lane's cursor, and the row is published."""
    monkeypatch.setattr("relay.sources.table.pending.SAFETY_NET_SECONDS", 1.0)
    s = fast(settings, stats_interval_seconds=0.5)
    topic = await new_topic()
    ob = Outbox(s)
    relay = await running(s)
    ids = await asyncio.to_thread(publish_numbered, engine, s, topic, 2000, keys=1)
    await read_ids(s.kafka_bootstrap_servers, topic, ids)
    lane = lane_for(b"k0", uuid.uuid4(), LANES)
    await wait_for(
        lambda: relay.source.cursors.known().get(lane, 0) > 1000, what="a cursor past 1000"
    )
    stray = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {ob.tables.events.fullname} (id, event_id, topic, key, lane,"
                " event_type, source, content_type, payload, fingerprint)"
                " VALUES (500, :e, :t, 'k0', :lane, 't', 's', 'application/json', '{}', '')"
            ),
            {"e": stray, "t": topic, "lane": lane},
        )
    back = await read_ids(s.kafka_bootstrap_servers, topic, [str(stray)], wait_seconds=30)
    assert str(stray) in {r.headers["ce_id"].decode() for r in back}
    assert relay.metrics.cursor_resets._value.get() >= 1


def table_reads(settings: OutboxSettings) -> int:
    """Row versions read from the outbox by sequential scans plus entries read from its
    primary key, once earlier work's statistics have arrived (see claim_index_reads)."""

    def read() -> int:
        with psycopg.connect(settings.libpq_dsn) as conn:
            row = conn.execute(
                "SELECT t.seq_tup_read + i.idx_tup_read FROM pg_stat_user_tables t"
                " JOIN pg_stat_user_indexes i USING (relid)"
                " WHERE t.schemaname = %s AND t.relname = %s AND i.indexrelname = %s",
                (
                    settings.db_schema,
                    f"{settings.table_prefix}events",
                    f"{settings.table_prefix}events_pkey",
                ),
            ).fetchone()
        assert row is not None
        return int(row[0])

    deadline = time.monotonic() + 30
    last = read()
    while True:
        time.sleep(1.5)
        now = read()
        if now - last < 1000 or time.monotonic() > deadline:
            return now
        last = now


async def test_retention_in_the_relay_does_not_rewalk_deleted_rows_while_a_snapshot_is_held(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
) -> None:
    """Keep-mode with the relay's retention every 0.5 s: each round resumes where the last
    one left off instead of walking the rows earlier rounds deleted (dead, not vacuumable)."""
    s = fast(settings, keep_published_hours=0.0003, cleanup_interval_seconds=0.5)
    topic = await new_topic(partitions=2)
    await running(s)
    events = f'"{s.db_schema}"."{s.table_prefix}events"'
    with held_snapshot(s):
        ids = await asyncio.to_thread(
            publish_numbered, engine, s, topic, DEAD_ROWS, keys=200, per_tx=1000
        )
        await read_ids(s.kafka_bootstrap_servers, topic, ids)

        def all_deleted() -> bool:
            with psycopg.connect(s.libpq_dsn) as conn:
                return conn.execute(f"SELECT count(*) FROM {events}").fetchone() == (0,)

        await wait_for(lambda: asyncio.to_thread(all_deleted), timeout=90, what="rows deleted")
        before = await asyncio.to_thread(table_reads, s)
        await asyncio.sleep(5)  # ten rounds
        after = await asyncio.to_thread(table_reads, s)
    # Each round walking the deleted rows would read them all (and their updated versions).
    print(f"retention rounds read {after - before} row versions / primary-key entries")
    assert after - before < DEAD_ROWS // 4, after - before


def test_failed_retry_puts_rows_back_with_new_ids_in_their_old_order(
    engine: Engine, settings: OutboxSettings
) -> None:
    """`outbox failed retry` gives rows new ids (a cursor may be past the old ones), in the
    order of the old ids, and still reports the failed-table ids it moved."""
    from relay import list_failed, retry_failed

    ob = Outbox(settings)
    t = ob.tables
    with engine.begin() as conn:
        old = ob.publish_many(conn, [_msg("t", "k", n) for n in range(3)])
        columns = (
            "id, event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at, attempts"
        )
        conn.execute(
            text(
                f"INSERT INTO {t.failed.fullname} ({columns}) SELECT {columns}"
                f" FROM {t.events.fullname}"
            )
        )
        conn.execute(text(f"DELETE FROM {t.events.fullname}"))
        newer = ob.publish_many(conn, [_msg("t", "k", 9)])
    failed_ids = [r.id for r in list_failed(settings)[0]]
    assert retry_failed(settings, failed_ids) == failed_ids
    with engine.connect() as conn:
        order = [
            str(r[0])
            for r in conn.execute(text(f"SELECT event_id FROM {t.events.fullname} ORDER BY id"))
        ]
        ids = conn.execute(text(f"SELECT min(id) FROM {t.events.fullname}")).scalar_one()
    assert order == [str(e) for e in newer + old]
    assert ids > max(failed_ids)


async def test_without_a_usable_horizon_claims_scan_from_the_lane_start_and_lose_nothing(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sequence that caches ids per session hands them out of order: the relay turns the
    horizon off (one warning), claims scan from the lane start as before, nothing is lost;
    CACHE 1 again and the cursors come back."""
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    with engine.begin() as conn:
        seq = conn.execute(text(f"SELECT pg_get_serial_sequence('{events}', 'id')")).scalar_one()
        conn.execute(text(f"ALTER SEQUENCE {seq} CACHE 20"))
    caplog.set_level("INFO", logger="relay.horizon")
    s = fast(settings)
    topic = await new_topic()
    relay = await running(s)
    # Sessions that cached ids keep them after CACHE 1 is back: publish through sessions of
    # their own, closed before that.
    caching = sync_engine(s)
    try:
        ids = await asyncio.to_thread(publish_numbered, caching, s, topic, 500, keys=20)
    finally:
        caching.dispose()
    records = await read_ids(s.kafka_bootstrap_servers, topic, ids)
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order) == (0, 0), v
    assert relay.source.cursors.horizon.value is None and relay.source.cursors.known() == {}
    assert [r.getMessage() for r in caplog.records].count(
        "claim horizon off: claims scan their lanes from the start (the outbox id sequence "
        "caches values per session or does not count upwards: ALTER SEQUENCE ... CACHE 1 "
        "NO CYCLE (the defaults))"
    ) == 1
    with engine.begin() as conn:
        conn.execute(text(f"ALTER SEQUENCE {seq} CACHE 1"))
    more = await asyncio.to_thread(publish_numbered, engine, s, topic, 500, keys=20, start=500)
    await read_ids(s.kafka_bootstrap_servers, topic, more)
    await wait_for(lambda: bool(relay.source.cursors.known()), timeout=20, what="cursors back")

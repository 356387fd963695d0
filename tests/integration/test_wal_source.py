"""The relay's WAL source (issue 39) as a subprocess on real PostgreSQL and Kafka: events
published as logical-decoding messages reach Kafka in per-key order, survive SIGKILLs of
the reader (a standby takes over), a refused event goes to the failed table, and a slot
lost under the relay stops it with exit 2 and one line."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import TOMBSTONE, Message, Outbox, UnsupportedInWalMode
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from relay.sources.wal.store import lsn_int
from relay.store import namespaces
from tests.support.kafka import create_topic, free_port, read_all
from tests.support.relay import (
    RelayProcess,
    outbox_cli,
    peak_rss_mib,
    publish_numbered,
    read_ids,
    read_slim,
    relay_env,
    verdict,
)
from tests.support.wal import confirmed_lsn, drop_slot, slot_reader, wait_until, wal_relay_env

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(wal_settings: OutboxSettings) -> OutboxSettings:
    return wal_settings


def _env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    return wal_relay_env(settings, **extra)


def _metrics_when(port: int, wanted: Callable[[list[str]], bool], timeout: float = 30) -> None:
    """Until the relay's /metrics shows what is ``wanted`` (gauges are read every few
    seconds)."""
    found: list[str] = []

    def shows() -> bool:
        nonlocal found
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            found = answer.read().decode().splitlines()
        return wanted(found)

    assert wait_until(shows, timeout), found


async def test_round_trip_in_key_order_with_every_envelope_field(
    engine: Engine,
    aengine: AsyncEngine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=4)
    ob = Outbox(settings)
    # 40 keys, in transactions of 100 (publish_many) and one by one (publish).
    ids = publish_numbered(engine, settings, topic, 4_000, keys=40)
    with engine.begin() as conn:
        for n in range(4_000, 4_040):
            ids.append(
                str(
                    ob.publish(
                        conn,
                        topic=topic,
                        key=f"k{n % 40}",
                        event_type="test.numbered",
                        payload={"key": f"k{n % 40}", "seq": n},
                        headers={"x-trace": "t1"},
                    )
                )
            )
    async with aengine.begin() as aconn:
        ids.append(
            str(
                await ob.publish_async(
                    aconn,
                    topic=topic,
                    key="k0",
                    event_type="test.numbered",
                    payload={"key": "k0", "seq": 4_040},
                    source="urn:async",
                )
            )
        )
        tomb = await ob.publish_many_async(
            aconn,
            [Message(topic=topic, key="gone", event_type="test.deleted", payload=TOMBSTONE)],
        )
    with engine.begin() as conn, pytest.raises(UnsupportedInWalMode):
        ob.publish(conn, topic=topic, event_type="t", payload={}, delay_seconds=5)
    # Nothing went through the outbox table.
    events = build_tables(settings).events
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {events.fullname}")).scalar_one() == 0
    before = confirmed_lsn(settings)
    port = free_port()
    relay = RelayProcess(_env(settings), tmp_path, "wal", "--metrics-port", str(port))
    try:
        records = await read_ids(settings.kafka_bootstrap_servers, topic, [*ids, str(tomb[0])])
        assert relay.alive(), relay.log()[-3000:]
        # The slot's gauges: wal_status reserved (0) and, once reading, a lag measured (not
        # -1: unknown, as on a standby).
        await asyncio.to_thread(
            _metrics_when,
            port,
            lambda lines: (
                "outbox_relay_wal_slot_status 0.0" in lines
                and "outbox_relay_wal_lag_seconds -1.0" not in lines
            ),
        )
        code, _ = relay.terminate()
    finally:
        relay.kill()
    assert code == 0, relay.log()[-3000:]
    numbered = [r for r in records if r.headers["ce_type"] == b"test.numbered"]
    v = verdict(numbered, ids)
    assert (v.lost, v.duplicates, v.out_of_order, v.unexpected) == (0, 0, 0, 0), v
    by_id = {r.headers["ce_id"].decode(): r for r in records}
    last = by_id[ids[-1]]
    assert last.headers["ce_source"] == b"urn:async"
    assert last.headers["content-type"] == b"application/json"
    assert json.loads(last.value) == {"key": "k0", "seq": 4_040}
    assert by_id[ids[-2]].headers["x-trace"] == b"t1"
    assert by_id[ids[-2]].headers["ce_specversion"] == b"1.0"
    assert by_id[ids[-2]].headers["ce_time"].endswith(b"Z")
    gone = by_id[str(tomb[0])]
    assert (gone.key, gone.value, "content-type" in gone.headers) == (b"gone", None, False)
    # The slot was confirmed past everything it published.
    after = confirmed_lsn(settings)
    assert before is not None and after is not None and after != before


async def test_sigkilled_readers_lose_nothing_and_a_standby_takes_over(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=6)
    # Small batches with a linger keep batches in flight, so kills land between a send
    # and the slot's advance; one reader still keeps up with the producer.
    env = _env(
        settings,
        OUTBOX_RELAY__BATCH_SIZE="200",
        OUTBOX_RELAY__LINGER_MS="100",
        OUTBOX_RELAY__POLL_INTERVAL_SECONDS="0.2",
    )
    # Three relays: one reads, two stand by (warm), so every kill meets a standby.
    relays = [RelayProcess(env, tmp_path, f"r{i}") for i in range(3)]
    ids: list[str] = []

    kills = takeovers = 0

    def produce() -> None:
        # Until 8 kills have landed mid-stream (at least 20,000 events, at most 60,000).
        chunk = 0
        while chunk < 600 and (chunk < 200 or kills < 8):
            ids.extend(publish_numbered(engine, settings, topic, 100, keys=40, start=chunk * 100))
            time.sleep(0.08)
            chunk += 1

    def reader(among: list[RelayProcess]) -> RelayProcess | None:
        return next((r for r in among if "reading the slot" in r.log()), None)

    producer = threading.Thread(target=produce)
    producer.start()
    rng = random.Random(11)
    try:
        while producer.is_alive():
            await asyncio.sleep(rng.uniform(1.0, 2.5))
            victim = reader(relays)
            if victim is None:
                continue
            victim.kill()
            kills += 1
            others = [r for r in relays if r is not victim]
            relays[relays.index(victim)] = RelayProcess(env, tmp_path, f"r-{kills}")
            # A standby takes over (not the relay started in the victim's place).
            if await asyncio.to_thread(wait_until, lambda o=others: reader(o) is not None, 30):
                takeovers += 1
        producer.join()
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, 120)
    finally:
        for r in relays:
            r.kill()
    v = verdict(records, ids)
    # Readers started from ever later confirmed positions: the slot advanced between kills.
    starts = await asyncio.to_thread(_start_positions, tmp_path)
    print(
        f"wal chaos: {kills} SIGKILLs, {takeovers} takeovers, {v.duplicates} duplicates, "
        f"{len(starts)} start positions"
    )
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert len(ids) >= 20_000 and kills >= 8 and takeovers == kills
    assert v.duplicates > 0  # some kill did land between a send and the slot's advance
    assert len(starts) > kills // 2


def _start_positions(logs: Path) -> set[str]:
    """The slot positions the relays logged when they began reading."""
    text = "".join(p.read_text(errors="replace") for p in logs.glob("r*.log"))
    return set(re.findall(r"confirmed_lsn=(\S+)", text))


async def test_a_refused_event_goes_to_the_failed_table_and_the_slot_moves_on(
    engine: Engine,
    settings: OutboxSettings,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await create_topic(kafka_bootstrap, None, 1, {"max.message.bytes": "2000"})
    ob = Outbox(settings)
    with engine.begin() as conn:
        before = ob.publish_many(
            conn,
            [
                Message(topic=topic, key="a", event_type="t", payload={"n": 1}),
                Message(topic=topic, key="a", event_type="t", payload=b"x" * 5000),
                Message(topic=topic, key="a", event_type="t", payload={"n": 2}),
            ],
        )
    env = _env(settings, OUTBOX_RELAY__MAX_ATTEMPTS="2")
    relay = RelayProcess(env, tmp_path, "wal")
    try:
        records = await read_ids(kafka_bootstrap, topic, [str(before[0]), str(before[2])])
        failed = build_tables(settings).failed
        found = await asyncio.to_thread(
            wait_until, lambda: _count(engine, failed.fullname) == 1, 60
        )
        assert found, relay.log()[-3000:]
        with engine.connect() as conn:
            row = conn.execute(
                text(f"SELECT event_id::text, attempts, last_error FROM {failed.fullname}")
            ).one()
        # Events after it are not held back: the slot moves on.
        with engine.begin() as conn:
            after = ob.publish(conn, topic=topic, key="a", event_type="t", payload={"n": 3})
        records += await read_ids(kafka_bootstrap, topic, [str(after)])
        # `outbox failed retry` in WAL mode puts it back into the WAL: it is read again,
        # refused again, and lands in the failed table again.
        retried = await asyncio.to_thread(outbox_cli, "failed", "retry", "--all", env=env)
        assert retried.returncode == 0 and "requeued 1" in retried.stdout, retried
        again = await asyncio.to_thread(
            wait_until, lambda: relay.log().count("moved to failed") == 2, 60
        )
        assert again, relay.log()[-3000:]
        # From a shell left on the table source it goes back into the outbox table, and
        # the relay reading the slot publishes it from there (no table relay runs): refused
        # again, in the failed table again, the table empty.
        table_shell = {**env, "OUTBOX_SOURCE": "table"}
        retried = await asyncio.to_thread(outbox_cli, "failed", "retry", "--all", env=table_shell)
        assert retried.returncode == 0 and "requeued 1" in retried.stdout, retried
        third = await asyncio.to_thread(
            wait_until, lambda: relay.log().count("moved to failed") == 3, 30
        )
        assert third and "rows of the outbox table settled" in relay.log(), relay.log()[-3000:]
        assert _count(engine, failed.fullname) == 1
        assert _count(engine, build_tables(settings).events.fullname) == 0
        assert relay.alive(), relay.log()[-3000:]
        code, _ = relay.terminate()
    finally:
        relay.kill()
    assert code == 0
    assert row[0] == str(before[1]) and row[1] == 2 and "Kafka rejected" in row[2]
    assert str(before[1]) not in {r.headers["ce_id"].decode() for r in records}
    assert "moved to failed" in relay.log()


def _count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


async def test_a_slot_dropped_under_the_relay_stops_it_with_exit_2_and_one_line(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    ids = publish_numbered(engine, settings, topic, 100)
    # No heartbeat during the test: the confirmed LSN moves only with the events.
    relay = RelayProcess(_env(settings, OUTBOX_WAL__HEARTBEAT_SECONDS="3600"), tmp_path, "wal")
    try:
        await read_ids(settings.kafka_bootstrap_servers, topic, ids)
        lsn = confirmed_lsn(settings)
        assert lsn is not None
        # The relay streams the slot (it is active): ending its session is the only way
        # to drop it, as an administrator would.
        await asyncio.to_thread(drop_slot, settings, 0)
        code = await asyncio.to_thread(relay.proc.wait, 60)
    finally:
        relay.kill()
    lines = [line for line in relay.log().splitlines() if "may be lost" in line]
    assert code == 2, relay.log()[-3000:]
    assert len(lines) == 1, relay.log()[-3000:]
    assert "outbox wal setup" in lines[0]
    # Where it had confirmed to: at least what every event read needed (it may have
    # confirmed the server's keepalive positions since: an idle slot moves).
    since = re.search(r"since LSN (\S+);", lines[0])
    assert since is not None and lsn_int(since[1]) >= lsn_int(lsn), lines[0]
    # Cut under the relay and gone when it came back; or gone under START_REPLICATION
    # (undefined_object).
    assert "SQLSTATE 42704" in lines[0] or "dropped while the relay was reconnecting" in lines[0]
    assert "Traceback" not in relay.log()


def test_a_missing_slot_at_start_exits_2_with_what_to_do(
    settings: OutboxSettings, tmp_path: Path
) -> None:
    drop_slot(settings, 5)
    relay = RelayProcess(_env(settings), tmp_path, "wal")
    try:
        code = relay.proc.wait(60)
    finally:
        relay.kill()
    assert code == 2
    assert "does not exist" in relay.log() and "outbox wal setup" in relay.log()
    assert "Traceback" not in relay.log()


async def test_a_50000_event_transaction_drains_with_bounded_relay_memory(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # 50,000 events of ~4 KB (~200 MB) committed in ONE transaction: pgoutput sends the
    # transaction whole at its commit; the relay's streams hold at most two batches each
    # and the server waits for the relay meanwhile (the stream's flow control).
    topic = await new_topic(partitions=6)
    ob = Outbox(settings)
    pad = "p" * 4000

    def commit() -> list[str]:
        with engine.begin() as conn:
            return [
                str(i)
                for i in ob.publish_many(
                    conn,
                    (
                        Message(
                            topic=topic,
                            key=f"k{n % 40}",
                            event_type="test.large",
                            payload={"key": f"k{n % 40}", "seq": n, "pad": pad},
                        )
                        for n in range(50_000)
                    ),
                )
            ]

    ids = await asyncio.to_thread(commit)
    relay = RelayProcess(_env(settings), tmp_path, "huge")
    try:
        records = await read_slim(settings.kafka_bootstrap_servers, topic, ids, 300)
        peak = peak_rss_mib(relay.pid)
        code, _ = relay.terminate()
    finally:
        relay.kill()
    print(f"50,000-event transaction (~200 MB): relay peak RSS {peak:.0f} MiB")
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert peak < 300, f"relay peak RSS {peak:.0f} MiB"
    assert code == 0, relay.log()[-3000:]


async def test_switching_from_table_to_wal_under_a_stream_keeps_every_key_in_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # A table relay slowed down (small batches, long linger) has a backlog when the
    # producer switches to the WAL: the WAL relay, running all along, must hold the WAL
    # events until the table's older ones are out, or keys would go out of order.
    topic = await new_topic(partitions=4)
    table = settings.model_copy(update={"source": "table"})
    slow = {"OUTBOX_RELAY__BATCH_SIZE": "20", "OUTBOX_RELAY__LINGER_MS": "50"}
    table_relay = RelayProcess(relay_env(table, **slow), tmp_path, "table")
    wal_relay = RelayProcess(_env(settings), tmp_path, "wal")
    ids: list[str] = []
    try:
        for chunk in range(40):  # table mode: 4,000 events in 40 transactions
            ids.extend(publish_numbered(engine, table, topic, 100, keys=40, start=chunk * 100))
        for chunk in range(40, 80):  # switched: the next 4,000 go to the WAL
            ids.extend(publish_numbered(engine, settings, topic, 100, keys=40, start=chunk * 100))
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, 180)
        assert "they go first" in wal_relay.log(), wal_relay.log()[-3000:]
    finally:
        table_relay.kill()
        wal_relay.kill()
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v


@pytest.mark.parametrize("heartbeat", ["0.5", "3600"], ids=["heartbeats", "keepalives"])
async def test_an_idle_slot_keeps_advancing(
    engine: Engine, settings: OutboxSettings, tmp_path: Path, heartbeat: str
) -> None:
    # No event at all, only other writes: the slot still moves past them, through the
    # relay's transactional heartbeats (a commit to confirm), or with heartbeats off (an
    # hour) through the WAL end of the server's keepalives, confirmed between transactions.
    env = _env(settings, OUTBOX_WAL__HEARTBEAT_SECONDS=heartbeat)
    relay = RelayProcess(env, tmp_path, "idle")
    try:
        assert await asyncio.to_thread(wait_until, lambda: slot_reader(settings) is not None, 30)
        with engine.begin() as conn:
            busy = "CREATE TEMP TABLE busy ON COMMIT DROP AS SELECT generate_series(1, 1000) g"
            conn.execute(text(busy))
            now = str(conn.execute(text("SELECT pg_current_wal_lsn()::text")).scalar_one())

        def past_now() -> bool:
            lsn = confirmed_lsn(settings)
            return lsn is not None and lsn_int(lsn) >= lsn_int(now)

        moved = await asyncio.to_thread(wait_until, past_now, 60)
        assert moved, relay.log()[-3000:]
        assert relay.alive()
    finally:
        relay.kill()


async def test_a_missing_topics_events_wait_while_other_topics_flow_then_go_in_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # A topic not created yet (a deployment step forgotten): its events wait in the relay's
    # memory (relay/sources/wal/held.py), the other topics' keep flowing, and once the operator
    # creates it they go out before the key's later events, with no command to run.
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    present = await new_topic(partitions=2)
    ob = Outbox(settings)

    def publish_missing(seqs: range) -> list[str]:
        with engine.begin() as conn:
            return [
                str(ob.publish(conn, topic=missing, key="k", event_type="t", payload={"seq": n}))
                for n in seqs
            ]

    port = free_port()
    relay = RelayProcess(_env(settings), tmp_path, "wal", "--metrics-port", str(port))
    try:
        early = publish_missing(range(3))
        ids = publish_numbered(engine, settings, present, 200, keys=10, per_tx=10)
        records = await read_ids(settings.kafka_bootstrap_servers, present, ids, 30)
        v = verdict(records, ids)
        assert (v.lost, v.out_of_order) == (0, 0), (v, relay.log()[-3000:])
        await asyncio.to_thread(
            _metrics_when, port, lambda lines: "outbox_relay_wal_held_events 3.0" in lines
        )
        await new_topic(name=missing, partitions=2)
        later = publish_missing(range(3, 6))
        got = await read_all(settings.kafka_bootstrap_servers, missing, expect=6, wait_seconds=30)
        assert [r.headers["ce_id"].decode() for r in got] == early + later
        await asyncio.to_thread(
            _metrics_when, port, lambda lines: "outbox_relay_wal_held_events 0.0" in lines
        )
        code, _ = relay.terminate()
    finally:
        relay.kill()
    log = relay.log()
    assert code == 0, log[-3000:]
    assert f"events of Kafka topic {missing} wait in memory until it exists" in log, log[-3000:]
    # The later events joined the queue if they came before it drained (3 or 6 delivered).
    assert re.search(rf"Kafka {missing} takes events again: its [36] held events are", log), log


async def test_table_rows_in_wal_mode_are_published_by_the_reader_in_key_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # Issue 51: the gate that lets older table rows go first held every WAL event for a
    # delayed row's whole delay, and for a stray table-mode row it held them for ever (no
    # table relay), with one INFO line. Now the reader publishes the table's rows itself,
    # at hold points (relay/sources/wal/table_rows.py); no table relay runs here.
    topic = await new_topic(partitions=2)
    table = settings.model_copy(update={"source": "table"})
    port = free_port()
    relay = RelayProcess(_env(settings), tmp_path, "wal", "--metrics-port", str(port))
    expected: list[str] = []

    async def arrived(ids: list[str], within: float) -> None:
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, within)
        assert not set(ids) - {r.headers["ce_id"].decode() for r in records}, relay.log()[-3000:]

    try:
        with engine.begin() as conn:  # a delayed event, in table mode, of key k0
            Outbox(table).publish(
                conn, topic=topic, key="k0", event_type="t.delayed", payload={}, delay_seconds=60
            )
        expected += publish_numbered(engine, settings, topic, 50, keys=5)
        await arrived(expected, 20)
        assert "the WAL stream waits" not in relay.log()
        # A stray table-mode publish (a cron job with the old setting), the stream idle:
        # published within 5 s with no table relay.
        started = time.monotonic()
        stray = publish_numbered(engine, table, topic, 1, keys=5, start=50)
        await arrived(stray, 10)
        idle_stray = time.monotonic() - started
        # One more, followed by WAL events of every key: they come after it.
        expected += stray + publish_numbered(engine, table, topic, 1, keys=5, start=51)
        expected += publish_numbered(engine, settings, topic, 50, keys=5, start=52)
        await arrived(expected, 20)
        # While a table relay's claim holds every lane's fence, the stream waits for the
        # stray row behind it, loudly, with the gauge up; then it goes, still first.
        fence = namespaces(settings.db_schema, settings.table_prefix)[2]
        warned = relay.log().count("the WAL stream waits")
        with psycopg.connect(settings.libpq_dsn) as claim:
            claim.execute(
                "SELECT pg_advisory_xact_lock(%s, lane) FROM generate_series(0, %s - 1) lane",
                (fence, settings.lanes),
            )
            expected += publish_numbered(engine, table, topic, 1, keys=5, start=102)
            expected += publish_numbered(engine, settings, topic, 50, keys=5, start=103)
            assert wait_until(lambda: relay.log().count("the WAL stream waits") > warned, 30)
            line = [x for x in relay.log().splitlines() if "the WAL stream waits" in x][-1]
            assert f"1 unpublished row(s) older than the next WAL transaction ({topic} 1)" in line
            assert "this relay publishes them" in line and "WARNING" in line, line
            _metrics_when(port, lambda lines: "outbox_relay_wal_table_rows_holding 1.0" in lines)
            await asyncio.sleep(1)
        released = time.monotonic()
        await arrived(expected[-51:-50], 10)
        after_release = time.monotonic() - released
        # A row a table relay put back for later (a partition Kafka did not answer for):
        # the next row of its lane (its key, here) waits behind it, 3 s.
        back = publish_numbered(engine, table, topic, 1, keys=5, start=153)
        events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"UPDATE {events} SET attempts = 1, last_error = 'PartitionUnavailable',"
                    " available_at = now() + interval '3 seconds' WHERE event_id = :id"
                ),
                {"id": back[0]},
            )
        expected += back + publish_numbered(engine, table, topic, 1, keys=5, start=158)
        records = await read_ids(settings.kafka_bootstrap_servers, topic, expected, 30)
        mine = [r for r in records if r.headers["ce_id"].decode() in set(expected)]
        v = verdict(mine, expected)
        assert (v.lost, v.out_of_order) == (0, 0), (v, relay.log()[-3000:])
        _metrics_when(port, lambda lines: "outbox_relay_wal_table_rows_holding 0.0" in lines)
        assert "rows of the outbox table settled" in relay.log()
        print(
            f"stray row, idle stream: {idle_stray:.2f} s; once the fences freed: "
            f"{after_release:.2f} s"
        )
        assert idle_stray < 5 and after_release < 5
    finally:
        relay.kill()

"""The relay as a subprocess: SIGKILL chaos with 3 relays, SIGTERM, metrics/health, a
Kafka outage on a private broker, and the `outbox failed` CLI."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.kafka import ServicesFailed, create_topic, private_broker
from tests.support.relay import (
    RelayProcess,
    commit_large,
    outbox_cli,
    peak_rss_mib,
    pending,
    publish_numbered,
    read_ids,
    read_slim,
    relay_env,
    verdict,
    wait_drained,
)
from tests.support.wal import wal_env, wal_source

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    # A relay publishes every pending row of its tables: give each test tables of its own.
    return isolated_settings


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_sigkill_chaos_with_three_relays_loses_nothing_and_keeps_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=6)
    # Small batches with a long linger keep the relays busy and every batch in flight for
    # ~100 ms, so most kills land between send and commit.
    env = relay_env(settings, OUTBOX_RELAY__BATCH_SIZE="50", OUTBOX_RELAY__LINGER_MS="100")
    relays = [RelayProcess(env, tmp_path, f"r{i}") for i in range(3)]
    ids: list[str] = []

    def produce() -> None:
        # 20,000 events over ~12 s in 200 transactions, so kills land mid-stream.
        for chunk in range(200):
            ids.extend(publish_numbered(engine, settings, topic, 100, keys=100, start=chunk * 100))
            time.sleep(0.06)

    producer = threading.Thread(target=produce)
    producer.start()
    rng = random.Random(7)
    kills = 0
    try:
        born = [time.monotonic()] * len(relays)
        while producer.is_alive():
            await asyncio.sleep(rng.uniform(0.3, 1.2))
            # The oldest relay that owns lanes, so the kill lands in its work: a relay killed
            # during its start-up proves nothing, and on a busy machine a start-up can take
            # longer than the pause between kills.
            working = [i for i, r in enumerate(relays) if "acquired lanes" in r.log()]
            if not working:
                continue
            victim = min(working, key=born.__getitem__)
            born[victim] = time.monotonic()
            relays[victim].kill()
            kills += 1
            relays[victim] = RelayProcess(env, tmp_path, f"r{victim}-{kills}")
        producer.join()
        left = await asyncio.to_thread(wait_drained, engine, settings, 60)
        assert left == 0, [r.log()[-2000:] for r in relays]
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids)
    finally:
        for r in relays:
            r.kill()
    v = verdict(records, ids)
    print(f"chaos: {kills} SIGKILLs, {len(ids)} events, {v.duplicates} duplicates")
    assert len(ids) == 20_000 and kills >= 8
    assert v.duplicates > 0  # some kill did land between send and commit
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v


async def test_sigterm_exits_zero_quickly_and_metrics_and_health_are_served(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=3)
    port = _free_port()
    relay = RelayProcess(relay_env(settings), tmp_path, "metrics", "--metrics-port", str(port))
    try:
        ids = publish_numbered(engine, settings, topic, 3000, keys=30, per_tx=500)
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
        assert verdict(records, ids).lost == 0
        deadline = time.monotonic() + 15
        while True:  # the pending gauge refreshes every stats interval
            body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
            if "outbox_relay_published_total 3000.0" in body or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert "outbox_relay_published_total 3000.0" in body
        for name in (
            "outbox_relay_batch_size_bucket",
            "outbox_relay_batch_seconds_bucket",
            "outbox_relay_owned_lanes 64.0",
            "outbox_relay_pending_events",
            "outbox_relay_oldest_pending_age_seconds",
        ):
            assert name in body, name
        assert await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz") == "ok\n"
        # SIGTERM while busy: the in-flight batch finishes or is released, exit 0 fast.
        more = publish_numbered(engine, settings, topic, 20_000, keys=30, per_tx=2000, start=3000)
        await asyncio.sleep(0.3)
        code, took = relay.terminate()
    finally:
        relay.kill()
    assert code == 0, relay.log()[-3000:]
    assert took < 8, took
    assert "relay stopped" in relay.log()
    # Whatever it did not publish is still pending; a new relay publishes the rest.
    relay2 = RelayProcess(relay_env(settings), tmp_path, "after")
    try:
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids + more)
    finally:
        relay2.kill()
    v = verdict(records, ids + more)
    assert (v.lost, v.out_of_order) == (0, 0), v


@pytest.fixture
def private_kafka(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A broker of our own (stopping the shared one would break everyone else's tests)."""
    try:
        with private_broker(tmp_path_factory.mktemp("kafka")) as broker:
            yield broker
    except ServicesFailed as exc:
        pytest.fail(str(exc), pytrace=False)


async def _first_new_record(
    bootstrap: str, topic: str, partitions: int, before: int, within: float
) -> float:
    """Seconds until ``topic`` holds more than ``before`` records (the sum of its end
    offsets; an upper bound, the client starting when the broker does)."""
    began = time.monotonic()
    consumer: AIOKafkaConsumer | None = None
    try:
        while time.monotonic() - began < within:
            with contextlib.suppress(KafkaError, OSError):
                if consumer is None:
                    starting = AIOKafkaConsumer(bootstrap_servers=bootstrap)
                    await starting.start()
                    consumer = starting
                ends = await consumer.end_offsets(
                    [TopicPartition(topic, p) for p in range(partitions)]
                )
                if sum(ends.values()) > before:
                    break
            await asyncio.sleep(0.05)
    finally:
        if consumer is not None:
            await consumer.stop()
    return time.monotonic() - began


@pytest.mark.parametrize("source", ["table", "wal"])
async def test_kafka_down_30s_then_back_all_arrive_within_2s_and_no_attempts_burned(
    engine: Engine,
    settings: OutboxSettings,
    private_kafka: tuple[str, Callable[[str], None]],
    tmp_path: Path,
    source: str,
) -> None:
    # The user's retry settings (the tests' relay_env shortens the backoff cap to 2 s): the
    # relay must notice Kafka's return itself, not when a 30 s backoff happens to end.
    bootstrap, services = private_kafka
    topic = await create_topic(bootstrap, None, 3)
    with contextlib.ExitStack() as stack:
        s = settings.model_copy(update={"kafka_bootstrap_servers": bootstrap})
        env = relay_env(s, OUTBOX_RETRY__BASE_SECONDS="0.1", OUTBOX_RETRY__CAP_SECONDS="30")
        if source == "wal":
            s = stack.enter_context(wal_source(s))
            env = {**env, **wal_env(s)}
        relay = RelayProcess(env, tmp_path, "outage")
        stack.callback(relay.kill)
        ids = publish_numbered(engine, s, topic, 1000, keys=20)
        first = await read_ids(bootstrap, topic, ids, wait_seconds=30)
        assert verdict(first, ids).lost == 0
        services("kafka-stop")
        down_at = time.monotonic()
        ids += publish_numbered(engine, s, topic, 2000, keys=20, start=1000)
        await asyncio.sleep(30 - (time.monotonic() - down_at))
        assert relay.alive(), relay.log()[-3000:]
        if source == "table":
            with engine.connect() as conn:
                burned = conn.execute(
                    text(
                        f"SELECT count(*) FROM {build_tables(s).events.fullname} WHERE attempts > 0"
                    )
                ).scalar_one()
            assert pending(engine, s) >= 1 and burned == 0
        services("kafka-start")  # returns once the broker listens
        resumed = await _first_new_record(bootstrap, topic, 3, 1000, 60)
        print(f"{source}: the first event of the outage in Kafka {resumed:.2f} s after its return")
        records = await read_ids(bootstrap, topic, ids, wait_seconds=90)
        left = await asyncio.to_thread(wait_drained, engine, s, 30) if source == "table" else 0
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert left == 0
    log = relay.log()
    assert resumed <= 2.0, log[-3000:]
    # A line or two when the outage starts and one when it ends, not one per retry. (The
    # WAL source holds a stalled partition's events in memory and reads on: it reports the
    # partitions, not Kafka as a whole.)
    said = [x for x in log.splitlines() if "relay.kafka:" in x and "unavailable" in x]
    assert 1 <= len(said) <= 3, log[-3000:]
    assert "partitions of" in log and "available again" in log, log[-3000:]


async def test_failed_cli_list_retry_purge(
    engine: Engine,
    settings: OutboxSettings,
    tmp_path: Path,
    kafka_bootstrap: str,
    new_topic: Callable[..., Awaitable[str]],
) -> None:
    s = settings.model_copy(update={"table_prefix": f"cli{uuid.uuid4().hex[:6]}_"})
    from outbox import Outbox, migrate

    migrate.upgrade(s)
    topic = await new_topic()
    with engine.begin() as conn:
        ids = [
            str(Outbox(s).publish(conn, topic=topic, key="k", event_type="t.big", payload=p))
            for p in ({"pad": "x" * 3000, "n": n} for n in range(3))
        ]
    # A relay whose record limit is below these rows: Kafka-side "too large", for good.
    small = relay_env(s, OUTBOX_RELAY__MAX_ATTEMPTS="1", OUTBOX_MAX_PAYLOAD_BYTES="2000")
    env = relay_env(s, COLUMNS="400")
    relay = RelayProcess(small, tmp_path, "cli")
    try:
        assert await asyncio.to_thread(wait_drained, engine, s, 30) == 0
    finally:
        relay.kill()
    listed = outbox_cli("failed", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "3 failed rows" in listed.stdout and "over the relay's limit" in listed.stdout
    bad = outbox_cli("failed", "retry", env=env)
    assert bad.returncode == 2  # neither ids nor --all: refused, nothing touched
    relay = RelayProcess(env, tmp_path, "cli-after")
    try:
        retried = outbox_cli("failed", "retry", "--all", env=env)
        assert retried.returncode == 0 and "requeued 3 rows" in retried.stdout, retried.stderr
        records = await read_ids(kafka_bootstrap, topic, ids, wait_seconds=30)
        assert {r.headers["ce_id"].decode() for r in records} == set(ids)
        assert "0 failed rows" in outbox_cli("failed", "list", env=env).stdout
        purged = outbox_cli("failed", "purge", "--all", "--yes", env=env)
        assert purged.returncode == 0 and "purged 0 rows" in purged.stdout
    finally:
        relay.kill()


async def test_a_missing_topic_holds_its_rows_without_burning_attempts(
    engine: Engine, settings: OutboxSettings, tmp_path: Path, kafka_bootstrap: str
) -> None:
    missing = f"later-{uuid.uuid4().hex[:8]}"
    ids = publish_numbered(engine, settings, missing, 3, keys=1)
    relay = RelayProcess(relay_env(settings, OUTBOX_RELAY__MAX_ATTEMPTS="1"), tmp_path, "missing")
    events = build_tables(settings).events.fullname
    failed = build_tables(settings).failed.fullname
    try:
        await asyncio.sleep(6)  # more than one re-check of the topic
        with engine.connect() as conn:
            waiting, burned = conn.execute(
                text(f"SELECT count(*), count(*) FILTER (WHERE attempts > 0) FROM {events}")
            ).one()
            moved = conn.execute(text(f"SELECT count(*) FROM {failed}")).scalar_one()
        assert (waiting, burned, moved) == (3, 0, 0), relay.log()[-3000:]
        await create_topic(kafka_bootstrap, missing, 1)
        records = await read_ids(kafka_bootstrap, missing, ids, wait_seconds=30)
    finally:
        relay.kill()
    assert verdict(records, ids).lost == 0
    log = relay.log()
    assert log.count("Kafka topic missing") == 1, log[-3000:]  # once, not per batch
    assert "outbox topics ensure --topic " + missing in log
    assert log.count("Kafka topic exists now") == 1, log[-3000:]


def test_relay_without_tables_exits_2_with_one_line_before_taking_lanes(
    settings: OutboxSettings, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"table_prefix": f"nope{uuid.uuid4().hex[:6]}_"})
    relay = RelayProcess(relay_env(s), tmp_path, "no-tables")
    try:
        code = relay.proc.wait(30)
    finally:
        relay.kill()
    assert code == 2
    [line] = [line for line in relay.log().splitlines() if line.strip()]
    assert line.startswith("error: SchemaMissing: no outbox tables in schema "), line
    assert "run `outbox db upgrade`" in line
    assert "outbox:outbox@" not in line  # no password in any line


async def test_relay_runs_retention_when_configured(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # Keep-mode marks published rows instead of deleting them; the relay's maintenance
    # task then deletes them once they are past retention (~1 s here).
    topic = await new_topic(partitions=2)
    events = build_tables(settings).events.fullname
    env = relay_env(
        settings,
        OUTBOX_RELAY__KEEP_PUBLISHED_HOURS="0.0003",
        OUTBOX_RELAY__CLEANUP_INTERVAL_SECONDS="0.5",
    )
    relay = RelayProcess(env, tmp_path, "maintenance")
    try:
        ids = publish_numbered(engine, settings, topic, 300, keys=10)
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
        assert verdict(records, ids).lost == 0
        counts: list[tuple[int, int]] = []  # (marked published, total) over time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                counts.append(
                    tuple(
                        conn.execute(
                            text(f"SELECT count(published_at), count(*) FROM {events}")
                        ).one()
                    )  # type: ignore[arg-type]
                )
            if counts[-1][1] == 0:
                break
            await asyncio.sleep(0.2)
    finally:
        code, _ = relay.terminate()
    assert any(marked > 0 for marked, _ in counts), "rows were never kept as published"
    assert counts[-1] == (0, 0), (counts[-5:], relay.log()[-2000:])
    assert code == 0
    assert "retention round" in relay.log()


async def test_a_backlog_of_large_rows_drains_within_the_memory_budget(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # 400 events of 900 KB committed before one relay with default settings starts: its
    # claims stop at their share of relay.max_inflight_bytes (48 MiB), so its peak resident
    # memory stays under 300 MiB; claims bounded only in rows (2,000) took ~800 MiB.
    topic = await new_topic(partitions=6)
    ids = await asyncio.to_thread(commit_large, engine, settings, topic, 400, 900_000)
    relay = RelayProcess(relay_env(settings), tmp_path, "large")
    try:
        left = await asyncio.to_thread(wait_drained, engine, settings, 180)
        peak = peak_rss_mib(relay.pid)
        records = await read_slim(settings.kafka_bootstrap_servers, topic, ids)
    finally:
        code, _ = relay.terminate()
    assert left == 0, relay.log()[-3000:]
    assert peak < 300, f"relay peak RSS {peak:.0f} MiB"
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert code == 0, relay.log()[-3000:]

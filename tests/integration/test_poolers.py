"""Behind a real PgBouncer (the Debian package, started by the fixtures): the session probe,
the producer path in transaction mode, the relay's refusal, and whole pipelines through a
transaction pooler (relays on their own direct URL) and through a session pooler."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.db import async_engine, sync_engine
from outbox.effects import Effects
from outbox.errors import DatabaseUnavailable, PoolerUnsupported
from outbox.idempotency import IdempotencyKeys
from outbox.outages import Dependency
from outbox.poolers import SessionProbe, probe_session
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay import Relay
from relay.database import Database
from relay.metrics import RelayMetrics
from relay.outage import OutageGuard
from relay.sources.table.cursor import ClaimCursors
from relay.sources.table.lanes import LaneManager
from relay.sources.table.pending import PendingStats
from relay.sources.table.store import ClaimStore
from tests.support.idempotency import create_effects_table, write_effect, write_effect_async
from tests.support.inbox import (
    effect_rows,
    effect_verdict,
    effects_table,
    outbox_cli,
    publish_keyed,
    wait_for,
)
from tests.support.pgbouncer import PgBouncer, free_port, pgbouncer
from tests.support.relay import (
    ROOT,
    RelayProcess,
    publish_numbered,
    read_ids,
    relay_env,
    verdict,
)
from tests.support.services import Endpoints

pytestmark = pytest.mark.integration
Bouncers = Callable[[str, int], PgBouncer]
NewTopic = Callable[..., Awaitable[str]]
TRANSACTION_POOL = 3  # few server connections: client connections keep changing sessions
TX = "transaction"


def through(settings: OutboxSettings, bouncer: PgBouncer, **update: Any) -> OutboxSettings:
    """``settings`` with database_url pointing at ``bouncer`` (same database)."""
    url = bouncer.url(settings.database_url.get_secret_value())
    return settings.model_copy(update={"database_url": SecretStr(url), **update})


def in_threads(worker: Callable[[int], None], n: int) -> list[BaseException]:
    """Run ``worker(0..n-1)`` in n threads; what they raised."""
    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            worker(w)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def outbox_rows(engine: Engine, settings: OutboxSettings) -> int:
    events = Outbox(settings).tables.events
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {events.fullname}")).scalar_one())


# ------------------------------------------------------------------------------ the probe


@pytest.mark.parametrize(
    ("mode", "pool_size", "expected"),
    [
        ("transaction", 1, "transaction"),  # one server session: the pid never changes
        ("transaction", TRANSACTION_POOL, "transaction"),
        ("session", 1, "session"),  # the second probe connection waits: the pool is full
        ("session", 40, "session"),
    ],
)
async def test_the_probe_tells_the_pool_mode(
    base_settings: OutboxSettings, pgbouncers: Bouncers, mode: str, pool_size: int, expected: str
) -> None:
    probe = await probe_session(through(base_settings, pgbouncers(mode, pool_size)))
    assert (probe.mode, probe.pooler) == (expected, "PgBouncer"), probe
    assert probe.stable is (expected == "session")
    direct = await probe_session(base_settings)
    assert (direct.mode, direct.pooler, direct.stable) == ("none", None, True)


async def test_the_probe_leaves_no_lock_on_a_stable_session(base_settings: OutboxSettings) -> None:
    async with await psycopg.AsyncConnection.connect(base_settings.libpq_dsn) as conn:
        await probe_session(base_settings, conn=conn)
        cur = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        assert await cur.fetchone() == (0,)


async def test_a_connection_lost_mid_probe_is_database_unavailable(
    base_settings: OutboxSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relay's lanes connection re-runs the probe on every reconnect, often while the
    # database is going away: the probe must fail as "unavailable" (retried by the relay),
    # not with an error of its own that stops the daemon.
    import outbox.poolers

    async def terminated(*_: Any) -> tuple[str | None, bool]:
        raise DatabaseUnavailable("database unavailable: terminating connection [SQLSTATE 57P01]")

    monkeypatch.setattr(outbox.poolers, "_rounds", terminated)
    with pytest.raises(DatabaseUnavailable, match="57P01"):
        await probe_session(base_settings)


# --------------------------------------------------------------- the producer path


def _prime_then_move(engine: Engine, bouncer: PgBouncer, database_url: str) -> None:
    """Run one statement on one client connection until psycopg would have prepared it,
    then hold that server session in another client's transaction and run it again: it
    now runs on another server session."""
    with engine.connect() as conn:
        for _ in range(8):
            pid = conn.execute(text("SELECT pg_backend_pid() + :x"), {"x": 0}).scalar_one()
            conn.commit()
        dsn = make_libpq(bouncer.url(database_url))
        for _ in range(20):  # LIFO: the server session just released comes first
            with psycopg.connect(dsn) as blocker:
                if blocker.execute("SELECT pg_backend_pid()").fetchone() == (pid,):
                    conn.execute(text("SELECT pg_backend_pid() + :x"), {"x": 0}).scalar_one()
                    return
        raise AssertionError("never got the primed server session")


def make_libpq(url: str) -> str:
    return OutboxSettings(database_url=SecretStr(url)).libpq_dsn


def test_prepared_statements_break_behind_a_transaction_pooler_unless_turned_off(
    base_settings: OutboxSettings, pgbouncers: Bouncers
) -> None:
    bouncer = pgbouncers("transaction", 2)
    url = base_settings.database_url.get_secret_value()
    plain = sync_engine(through(base_settings, bouncer), pool_size=1)
    try:
        with pytest.raises(DBAPIError) as info:
            _prime_then_move(plain, bouncer, url)
        assert isinstance(info.value.orig, psycopg.errors.InvalidSqlStatementName)
    finally:
        plain.dispose()
    safe = sync_engine(through(base_settings, bouncer, db_pooler="transaction"), pool_size=1)
    try:
        _prime_then_move(safe, bouncer, url)
    finally:
        safe.dispose()


def test_sync_engine_publishes_3000_events_through_a_transaction_pooler(
    isolated_settings: OutboxSettings, engine: Engine, pgbouncers: Bouncers
) -> None:
    s = through(
        isolated_settings, pgbouncers("transaction", TRANSACTION_POOL), db_pooler="transaction"
    )
    pooled = sync_engine(s, pool_size=6)
    outbox = Outbox(s)

    def worker(w: int) -> None:
        for n in range(500):
            with Session(pooled) as session, session.begin():
                outbox.publish(
                    session, topic="t", key=f"k{n % 7}", event_type="e", payload={"w": w}
                )

    try:
        assert in_threads(worker, 6) == []
    finally:
        pooled.dispose()
    assert outbox_rows(engine, s) == 3000


async def test_async_engine_publishes_3000_events_through_a_transaction_pooler(
    isolated_settings: OutboxSettings, engine: Engine, pgbouncers: Bouncers
) -> None:
    s = through(
        isolated_settings, pgbouncers("transaction", TRANSACTION_POOL), db_pooler="transaction"
    )
    pooled = async_engine(s, pool_size=6)
    outbox = Outbox(s)
    errors: list[BaseException] = []

    async def worker(w: int) -> None:
        for n in range(500):
            try:
                async with pooled.begin() as conn:
                    await outbox.publish_async(
                        conn, topic="t", key=f"k{n % 7}", event_type="e", payload={"w": w}
                    )
            except Exception as exc:
                errors.append(exc)

    try:
        await asyncio.gather(*(worker(w) for w in range(6)))
    finally:
        await pooled.dispose()
    assert errors == []
    assert outbox_rows(engine, s) == 3000


def test_idempotency_keys_and_effects_run_through_a_transaction_pooler(
    settings: OutboxSettings, engine: Engine, pgbouncers: Bouncers
) -> None:
    create_effects_table(engine)
    s = through(settings, pgbouncers("transaction", TRANSACTION_POOL), db_pooler=TX)
    pooled = sync_engine(s, pool_size=4)
    keys, effects, outbox = IdempotencyKeys(s), Effects(s), Outbox(s)
    scope = f"pool-{uuid.uuid4().hex[:8]}"
    calls: list[str] = []

    def worker(w: int) -> None:
        for n in range(30):
            key = f"{w}-{n}"
            body = {"amount": n}
            for _ in range(2):  # the second run of each is a replay
                keys.run(
                    pooled,
                    scope=scope,
                    key=key,
                    payload=body,
                    operation=lambda session, key=key, body=body: write_effect(
                        session, outbox, scope, key, body
                    ),
                )
                effects.run(
                    pooled, key=f"{scope}-{key}", payload=body, call=lambda k: calls.append(k)
                )

    try:
        assert in_threads(worker, 4) == []
    finally:
        pooled.dispose()
    assert len(calls) == len(set(calls)) == 120  # each effect called once, replayed once
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT count(*) FROM idem_effects WHERE scope = :s"), {"s": scope}
        ).scalar_one()
    assert rows == 120


async def test_idempotency_keys_async_run_through_a_transaction_pooler(
    settings: OutboxSettings, engine: Engine, pgbouncers: Bouncers
) -> None:
    create_effects_table(engine)
    s = through(settings, pgbouncers("transaction", TRANSACTION_POOL), db_pooler=TX)
    pooled = async_engine(s, pool_size=4)
    keys, effects, outbox = IdempotencyKeys(s), Effects(s), Outbox(s)
    scope = f"apool-{uuid.uuid4().hex[:8]}"
    calls: list[str] = []

    async def call(key: str) -> str:
        calls.append(key)
        return key

    async def worker(w: int) -> None:
        for n in range(30):
            key, body = f"{w}-{n}", {"amount": n}
            for _ in range(2):
                await keys.run_async(
                    pooled,
                    scope=scope,
                    key=key,
                    payload=body,
                    operation=lambda session, key=key, body=body: write_effect_async(
                        session, outbox, scope, key, body
                    ),
                )
                await effects.run_async(pooled, key=f"{scope}-{key}", payload=body, call=call)

    try:
        await asyncio.gather(*(worker(w) for w in range(4)))
    finally:
        await pooled.dispose()
    assert len(calls) == len(set(calls)) == 120


# ------------------------------------------------------------------------------ the relay

RELAY_FIX = "OUTBOX_RELAY__DATABASE_URL"


@pytest.mark.parametrize("pool_size", [1, TRANSACTION_POOL])
async def test_the_relay_refuses_a_transaction_pooler_before_taking_lanes(
    isolated_settings: OutboxSettings, pgbouncers: Bouncers, pool_size: int
) -> None:
    s = through(isolated_settings, pgbouncers("transaction", pool_size))
    relay = Relay(s)
    started = time.monotonic()
    with pytest.raises(PoolerUnsupported) as info:
        await relay.run()
    took = time.monotonic() - started
    message = str(info.value)
    assert "PgBouncer in transaction mode" in message and RELAY_FIX in message, message
    assert relay.source.lanes.owned == frozenset()
    print(f"refused in {took:.3f}s")
    assert took < 5


async def test_the_relay_takes_db_pooler_transaction_at_its_word(
    isolated_settings: OutboxSettings,
) -> None:
    with pytest.raises(PoolerUnsupported) as info:
        await Relay(isolated_settings.model_copy(update={"db_pooler": "transaction"})).run()
    assert "OUTBOX_DB_POOLER=transaction" in str(info.value) and RELAY_FIX in str(info.value)


def _lane_manager(s: OutboxSettings) -> LaneManager:
    metrics, store = RelayMetrics(lanes=s.lanes), ClaimStore.of(s)
    guard = OutageGuard(Dependency("database", logging.getLogger()), RetryPolicy())
    pending = PendingStats(s.lanes, 5.0, store, ClaimCursors(), metrics)
    return LaneManager(s.relay, s.lanes, Database(s), store, guard, metrics, pending)


async def test_the_lane_heartbeat_notices_a_moved_session(
    isolated_settings: OutboxSettings, pgbouncers: Bouncers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backstop behind the probe: if the lock connection ever answers from another
    backend than the one that joined, the relay stops instead of trusting its locks."""
    bouncer = pgbouncers("transaction", 2)
    s = through(isolated_settings, bouncer)

    async def probe_missed(*args: object) -> SessionProbe:
        return SessionProbe("session", "PgBouncer", "-", "fooled")

    monkeypatch.setattr("relay.database.check_session", probe_missed)
    lanes = _lane_manager(s)
    conn = await lanes._connect()
    lanes._conn = conn
    joined = lanes._backend
    # Hold the server session the join ran on in another client's transaction: the next
    # heartbeat has to run on the other one.
    for _ in range(20):
        blocker = await psycopg.AsyncConnection.connect(s.libpq_dsn)
        cur = await blocker.execute("SELECT pg_backend_pid()")
        if await cur.fetchone() == (joined,):
            break
        await blocker.close()
    else:
        raise AssertionError("never got the join's server session")
    try:
        with pytest.raises(PoolerUnsupported) as info:
            await lanes._tick()
    finally:
        await blocker.close()
        await lanes.close()
    assert f"moved from backend {joined}" in str(info.value)
    assert lanes.owned == frozenset()


def test_outbox_relay_through_a_transaction_pooler_exits_2_with_one_line(
    isolated_settings: OutboxSettings, pgbouncers: Bouncers, tmp_path: Path
) -> None:
    s = through(isolated_settings, pgbouncers("transaction", TRANSACTION_POOL))
    relay = RelayProcess(relay_env(s), tmp_path, "refused")
    started = time.monotonic()
    try:
        code = relay.proc.wait(60)
    finally:
        relay.kill()
    took = time.monotonic() - started
    lines = [line for line in relay.log().splitlines() if line.strip()]
    print(f"`outbox relay` exited {code} after {took:.2f}s (process start included)")
    assert code == 2, lines
    assert len(lines) == 1, lines  # no traceback, no second opinion
    assert "PgBouncer in transaction mode" in lines[0] and RELAY_FIX in lines[0], lines
    assert "outbox:outbox@" not in lines[0]


async def test_the_relay_refuses_when_its_reconnect_lands_on_a_transaction_pooler(
    isolated_settings: OutboxSettings,
    services: Endpoints,
    engine: Engine,
    new_topic: NewTopic,
    tmp_path: Path,
) -> None:
    """Lanes reconnect through whatever the URL leads to now: a session pooler replaced
    by a transaction pooler on the same port stops the relay (exit 2), it never keeps
    running on locks the pooler would share."""
    port = free_port()
    topic = await new_topic(partitions=2)
    with pgbouncer(services.database_url, "session", 20, port=port) as session_pool:
        s = through(isolated_settings, session_pool)
        relay = RelayProcess(relay_env(s), tmp_path, "reconnect")
        try:
            ids = publish_numbered(engine, s, topic, 200, keys=10)
            records = await read_ids(s.kafka_bootstrap_servers, topic, ids, wait_seconds=30)
            assert verdict(records, ids).lost == 0, relay.log()[-3000:]
            session_pool.stop()  # the relay's connections drop; it retries
            with pgbouncer(services.database_url, "transaction", TRANSACTION_POOL, port=port):
                code = await asyncio.to_thread(relay.proc.wait, 60)
        finally:
            relay.kill()
    log = relay.log()
    assert code == 2, log[-3000:]
    assert "PgBouncer in transaction mode" in log and RELAY_FIX in log, log[-3000:]


# ------------------------------------------------------------------ whole pipelines

EVENTS, KEYS = 6_000, 60
TARGET = "tests.support.inbox_apps:app"


async def _pipeline(
    engine: Engine,
    producer: OutboxSettings,
    relay_env_: dict[str, str],
    consumer_env: dict[str, str],
    tmp_path: Path,
) -> tuple[tuple[int, int, int], dict[str, str]]:
    """Producer (in this process) -> two relays -> one consumer, ~1,000 events/s for ~6 s;
    one relay is SIGKILLed 2 s into the stream. Returns the effects' (lost, duplicates,
    out-of-order) and each daemon's log."""
    table = consumer_env["INBOX_TEST_EFFECTS"]
    relays = [RelayProcess(relay_env_, tmp_path, f"relay-{i}") for i in range(2)]
    consumer = outbox_cli(["--log-level", "WARNING", "consume", TARGET], consumer_env)
    stop = threading.Event()
    publisher = threading.Thread(
        target=publish_keyed,
        args=(producer, consumer_env["INBOX_TEST_TOPIC"], EVENTS),
        kwargs={"keys": KEYS, "chunk": 100, "pause": 0.1, "stop": stop},
    )

    def applied() -> int:
        return len(effect_rows(engine, table))

    try:
        await wait_for(
            lambda: all("acquired lanes" in r.log() for r in relays), what="both relays up"
        )
        publisher.start()
        await asyncio.sleep(2)
        relays[0].kill()
        assert publisher.is_alive(), "the kill should land mid-stream"
        await wait_for(lambda: applied() >= EVENTS, timeout=240, what="every effect")
        await asyncio.sleep(2)  # room for a late duplicate to show up
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join(60)
        consumer.send_signal(signal.SIGTERM)
        code, _ = relays[1].terminate()
        consumer_code = consumer.wait(60)
        for r in relays:
            r.kill()
    assert consumer.stderr is not None
    logs = {"consumer": consumer.stderr.read().decode(errors="replace")}
    logs.update({f"relay-{i}": r.log() for i, r in enumerate(relays)})
    assert (code, consumer_code) == (0, 0), logs
    return effect_verdict(effect_rows(engine, table), EVENTS), logs


def _daemon_env(settings: OutboxSettings, topic: str, table: str, **extra: str) -> dict[str, str]:
    return relay_env(
        settings,
        PYTHONPATH=str(ROOT),
        INBOX_TEST_CONSUMER=f"pool-{uuid.uuid4().hex[:8]}",
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        **extra,
    )


async def test_producer_and_consumer_through_a_transaction_pooler_relays_direct(
    isolated_settings: OutboxSettings,
    engine: Engine,
    pgbouncers: Bouncers,
    new_topic: NewTopic,
    tmp_path: Path,
) -> None:
    pooled = through(isolated_settings, pgbouncers("transaction", TRANSACTION_POOL))
    topic, table = await new_topic(partitions=4), effects_table(engine)
    # Everyone gets the pooler's URL; the relays also get their own direct one. The
    # consumer is not told about the pooler: it finds out (and says so).
    consumer_env = _daemon_env(pooled, topic, table)
    relays_env = consumer_env | {
        "OUTBOX_DB_POOLER": "transaction",
        "OUTBOX_RELAY__DATABASE_URL": isolated_settings.database_url.get_secret_value(),
    }
    verdict_, logs = await _pipeline(
        engine,
        pooled.model_copy(update={"db_pooler": "transaction"}),
        relays_env,
        consumer_env,
        tmp_path,
    )
    assert verdict_ == (0, 0, 0), verdict_
    assert "database behind a transaction pooler" in logs["consumer"], logs["consumer"]
    assert "session=PostgreSQL itself" in logs["relay-1"], logs["relay-1"][-2000:]


async def test_everything_through_a_session_pooler(
    isolated_settings: OutboxSettings,
    engine: Engine,
    pgbouncers: Bouncers,
    new_topic: NewTopic,
    tmp_path: Path,
) -> None:
    pooled = through(isolated_settings, pgbouncers("session", 40))
    topic, table = await new_topic(partitions=4), effects_table(engine)
    env = _daemon_env(pooled, topic, table)
    verdict_, logs = await _pipeline(engine, pooled, env, env, tmp_path)
    assert verdict_ == (0, 0, 0), verdict_
    assert "session=PgBouncer in session mode" in logs["relay-1"], logs["relay-1"][-2000:]
    assert "transaction pooler" not in logs["consumer"], logs["consumer"]

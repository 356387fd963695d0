"""Relay benchmark: throughput of 1, 2 and 4 relay processes draining a backlog, against
a naive relay and the raw database ceiling measured in the same run; commit-to-append
latency at a steady rate; and the cost of a NOTIFY trigger on producer commits.

    python -m bench.relay                       # defaults: 200,000 rows, ~2-3 minutes
    python -m bench.relay --rows 50000 --relays 1,2
    python -m bench.relay --rows 50000 --kafka-security secure.env   # SASL_SSL vs plaintext

``--kafka-security FILE`` only compares one relay draining the backlog over the plaintext
settings of the environment and over the Kafka settings in FILE (a dotenv file with
OUTBOX_KAFKA_BOOTSTRAP_SERVERS and OUTBOX_KAFKA__*, e.g. the SASL_SSL listener of
``scripts/services``: see the README's benchmark section).

Needs the services of ``scripts/services up`` (or OUTBOX_DATABASE_URL and
OUTBOX_KAFKA_BOOTSTRAP_SERVERS). Works in a fresh database that it drops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from dotenv import dotenv_values
from sqlalchemy.engine import make_url

from bench import tracing
from bench.common import create_topic
from outbox import Outbox, migrate
from outbox.daemon import kafka_consumer, kafka_environment, kafka_producer
from outbox.db import sync_engine
from outbox.envelope import Message, lane_for
from outbox.settings import KafkaSettings, OutboxSettings
from relay.store import CLAIM_SESSION_SETTINGS, RelayStore

KEYS = 1000
PAD = 250  # JSON payload of ~300 bytes


def _dsn(settings: OutboxSettings, database: str) -> str:
    url = make_url(settings.database_url.get_secret_value()).set(
        drivername="postgresql", database=database
    )
    return url.render_as_string(hide_password=False)


def fill(settings: OutboxSettings, topic: str, rows: int, *, analyze: bool = True) -> float:
    """Insert ``rows`` pending events in one transaction (keys k0..k999, lanes as
    publish() computes them); returns the perf_counter time of the commit."""
    keys = [f"k{i}".encode() for i in range(KEYS)]
    lanes = [lane_for(k, uuid.uuid4(), settings.lanes) for k in keys]
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    with psycopg.connect(settings.libpq_dsn) as conn:
        conn.execute(
            f"INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
            " content_type, payload, fingerprint, headers)"
            " SELECT gen_random_uuid(), %(topic)s, (%(keys)s::bytea[])[1 + g %% %(k)s],"
            " (%(lanes)s::int2[])[1 + g %% %(k)s], 'bench.event', 'urn:bench',"
            " 'application/json',"
            " convert_to('{\"n\":' || g || ',\"pad\":\"' || repeat('x', %(pad)s) || '\"}', 'UTF8'),"
            " '\\x00'::bytea, %(headers)s::jsonb FROM generate_series(1, %(rows)s) g",
            {
                "topic": topic,
                "keys": keys,
                "lanes": lanes,
                "k": KEYS,
                "pad": PAD,
                "rows": rows,
                "headers": json.dumps(
                    {"traceparent": tracing.TRACEPARENT} if tracing.enabled() else {}
                ),
            },
        )
        conn.commit()
        committed = time.perf_counter()
    if analyze:
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
            conn.execute(f"VACUUM ANALYZE {events}")
    return committed


def pending(settings: OutboxSettings) -> int:
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    with psycopg.connect(settings.libpq_dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {events} WHERE published_at IS NULL").fetchone()
    return int(row[0]) if row else 0


def relay_env(settings: OutboxSettings) -> dict[str, str]:
    # OUTBOX_RELAY__* from the caller's environment pass through (tuning experiments).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_RELAY__")
    }
    env.setdefault("OUTBOX_RELAY__HEARTBEAT_SECONDS", "0.5")
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        **kafka_environment(settings),
    )
    return env


def start_relays(settings: OutboxSettings, n: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    exe = Path(sys.executable).with_name("outbox")
    command = [str(exe) if exe.exists() else "outbox"]
    if tracing.enabled():
        command = [sys.executable, "-m", "bench.tracing"]
    return [
        subprocess.Popen(
            [*command, "--log-level", "WARNING", "relay"],
            env=relay_env(settings),
            stdout=(logs / f"relay-{n}-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]


def stop_relays(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_balanced(settings: OutboxSettings, n: int, timeout: float = 60) -> None:
    """Until ``n`` relays are registered and together own every lane."""
    relays = f'"{settings.db_schema}"."{settings.table_prefix}relays"'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(settings.libpq_dsn) as conn:
            rows = conn.execute(
                f"SELECT cardinality(lanes) FROM {relays}"
                " WHERE heartbeat_at > now() - interval '2 seconds'"
            ).fetchall()
        if len(rows) == n and sum(r[0] for r in rows) == settings.lanes:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n} relays did not share the lanes within {timeout} s")


def drain_with_relays(settings: OutboxSettings, topic: str, rows: int, n: int, logs: Path) -> float:
    """Events/s of ``n`` relay processes draining a ``rows`` backlog. The relays are
    started and balanced first; the backlog appears in one commit and the clock runs from
    that commit until the outbox is empty (process start-up is not measured)."""
    procs = start_relays(settings, n, logs)
    try:
        wait_balanced(settings, n)
        t0 = fill(settings, topic, rows, analyze=False)
        left = rows
        deadline = t0 + 600
        while left and time.perf_counter() < deadline:
            time.sleep(0.05)
            left = pending(settings)
        elapsed = time.perf_counter() - t0
    finally:
        stop_relays(procs)
    if left:
        raise RuntimeError(f"{n} relay(s) left {left} rows; see {logs}")
    return rows / elapsed


async def naive_relay(settings: OutboxSettings, topic: str, rows: int) -> float:
    """The textbook relay: select 100 in id order, send_and_wait each, delete each."""
    fill(settings, topic, rows)
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    producer = kafka_producer(settings, acks="all", enable_idempotence=True)
    await producer.start()
    done = 0
    t0 = time.perf_counter()
    try:
        async with await psycopg.AsyncConnection.connect(settings.libpq_dsn) as conn:
            while True:
                cur = await conn.execute(
                    f"SELECT id, key, payload, event_id::text FROM {events}"
                    " WHERE published_at IS NULL ORDER BY id LIMIT 100"
                )
                batch = await cur.fetchall()
                if not batch:
                    break
                for row_id, key, payload, event_id in batch:
                    await producer.send_and_wait(
                        topic, payload, key=key, headers=[("ce_id", event_id.encode())]
                    )
                    await conn.execute(f"DELETE FROM {events} WHERE id = %s", (row_id,))
                    done += 1
                await conn.commit()
    finally:
        await producer.stop()
    return done / (time.perf_counter() - t0)


def db_ceiling(settings: OutboxSettings, topic: str, rows: int) -> tuple[float, float]:
    """Rows/s of (a) the relay's own claim statement (fence + per-lane LATERAL + DELETE
    ... RETURNING, batch 2000) and (b) the plain DELETE ... IN (SELECT ... FOR UPDATE SKIP
    LOCKED LIMIT 2000) RETURNING, both with no Kafka at all."""
    store = RelayStore(settings)
    lanes = list(range(settings.lanes))
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    plain = (
        f"DELETE FROM {events} WHERE id IN (SELECT id FROM {events}"
        " WHERE published_at IS NULL AND available_at <= now() ORDER BY id LIMIT 2000"
        " FOR UPDATE SKIP LOCKED) RETURNING id, key, payload, event_id::text"
    )
    results = []
    for use_store in (True, False):
        fill(settings, topic, rows)
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
            conn.execute(CLAIM_SESSION_SETTINGS)
            t0 = time.perf_counter()
            done, rot = 0, 0
            while True:
                with conn.transaction():
                    cur = conn.cursor(binary=True)
                    if use_store:
                        rot = (rot + 1) % len(lanes)
                        cur.execute(
                            store.claim, {"lanes": lanes[rot:] + lanes[:rot], "limit": 2000}
                        )
                    else:
                        cur.execute(plain)  # type: ignore[arg-type]
                    got = len(cur.fetchall())
                if not got:
                    break
                done += got
            results.append(done / (time.perf_counter() - t0))
    return results[0], results[1]


async def latency(
    settings: OutboxSettings, rate: int, seconds: float, logs: Path
) -> tuple[float, float, int]:
    """p50/p99 ms from producer commit to the broker's append (LogAppendTime) at ``rate``
    single-event transactions per second, one relay running."""
    topic = await create_topic(settings, 6, {"message.timestamp.type": "LogAppendTime"})
    procs = start_relays(settings, 1, logs)
    ob = Outbox(settings)
    engine = sync_engine(settings)
    committed: dict[str, float] = {}
    try:
        await asyncio.sleep(3)  # let the relay connect and own its lanes
        t0 = time.perf_counter()
        n = 0
        while (elapsed := time.perf_counter() - t0) < seconds:
            due = int(elapsed * rate)
            if due > n:
                # One transaction for what is due (a few events per ~5 ms tick): a single
                # Python client cannot commit 1,000 one-event transactions per second here.
                with engine.begin() as conn:
                    eids = ob.publish_many(
                        conn,
                        [
                            Message(
                                topic=topic,
                                key=f"k{i % KEYS}",
                                event_type="bench.latency",
                                payload={"n": i, "pad": "x" * PAD},
                            )
                            for i in range(n, due)
                        ],
                    )
                now = time.time()
                committed.update((str(e), now) for e in eids)
                n = due
            await asyncio.sleep(0.005)
        records = await read_topic(settings, topic, len(committed))
    finally:
        stop_relays(procs)
        engine.dispose()
    lat = [ts / 1000 - committed[eid] for eid, ts in records if eid in committed]
    lat.sort()
    return lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000, len(lat)


async def read_topic(settings: OutboxSettings, topic: str, expect: int) -> list[tuple[str, int]]:
    consumer = kafka_consumer(settings, auto_offset_reset="earliest", enable_auto_commit=False)
    consumer.subscribe([topic])
    await consumer.start()
    out: list[tuple[str, int]] = []
    try:
        deadline = time.monotonic() + 60
        while len(out) < expect and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for msgs in batch.values():
                out.extend((dict(m.headers)["ce_id"].decode(), m.timestamp) for m in msgs)
    finally:
        await consumer.stop()
    return out


def notify_cost(settings: OutboxSettings, clients: int, seconds: int) -> tuple[float, float] | None:
    """Producer commits/s (pgbench, one-row INSERT transactions) without and with a
    statement-level trigger that calls pg_notify once per transaction."""
    if not shutil.which("pgbench"):
        return None
    url = make_url(settings.database_url.get_secret_value())
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_notify (id bigint GENERATED BY DEFAULT AS IDENTITY"
            " PRIMARY KEY, payload text)"
        )
        conn.execute(
            "CREATE FUNCTION bench_wake() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_notify('bench_wake', ''); RETURN NULL; END $$"
        )
    script = Path(tempfile.mkdtemp()) / "insert.sql"
    script.write_text(f"INSERT INTO bench_notify (payload) VALUES (repeat('x', {PAD + 50}));\n")
    env = {**os.environ, "PGPASSWORD": url.password or ""}
    tps = []
    for with_trigger in (False, True):
        if with_trigger:
            with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
                conn.execute(
                    "CREATE TRIGGER bench_wake AFTER INSERT ON bench_notify"
                    " FOR EACH STATEMENT EXECUTE FUNCTION bench_wake()"
                )
        res = subprocess.run(
            [
                "pgbench",
                "-n",
                "-h",
                url.host or "127.0.0.1",
                "-p",
                str(url.port or 5432),
                "-U",
                url.username or "postgres",
                "-f",
                str(script),
                "-c",
                str(clients),
                "-j",
                "2",
                "-T",
                str(seconds),
                url.database or "postgres",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(x for x in res.stdout.splitlines() if x.startswith("tps"))
        tps.append(float(line.split("=")[1].split()[0]))
    return tps[0], tps[1]


def with_kafka_from(settings: OutboxSettings, path: Path) -> OutboxSettings:
    """``settings`` with the Kafka connection of the dotenv file ``path``."""
    values = {k: v for k, v in dotenv_values(path).items() if v is not None}
    nested: dict[str, object] = {
        k.removeprefix("OUTBOX_KAFKA__").lower(): v
        for k, v in values.items()
        if k.startswith("OUTBOX_KAFKA__")
    }
    if isinstance(nested.get("options"), str):
        nested["options"] = json.loads(str(nested["options"]))
    return settings.model_copy(
        update={
            "kafka": KafkaSettings.model_validate(nested),
            "kafka_bootstrap_servers": values.get(
                "OUTBOX_KAFKA_BOOTSTRAP_SERVERS", settings.kafka_bootstrap_servers
            ),
        }
    )


def compare_security(
    settings: OutboxSettings, secured: OutboxSettings, rows: int, partitions: int, logs: Path
) -> dict[str, float]:
    """One relay draining ``rows`` over each connection (one run each)."""
    rates: dict[str, float] = {}
    for name, s in (("plaintext", settings), (secured.kafka.security_protocol, secured)):
        topic = asyncio.run(create_topic(s, partitions))
        rates[name] = drain_with_relays(s, topic, rows, 1, logs)
        print(f"1 relay over {name}: {rates[name]:,.0f} events/s ({rows} rows)")
    secure = rates[secured.kafka.security_protocol]
    print(f"{secured.kafka.security_protocol} / plaintext: {secure / rates['plaintext']:.2f}")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--relays", default="1,2,4")
    ap.add_argument("--naive-rows", type=int, default=5_000)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--latency-seconds", type=float, default=10)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument(
        "--kafka-security",
        type=Path,
        metavar="ENV_FILE",
        help="only compare 1 relay over plaintext vs the Kafka settings in ENV_FILE",
    )
    args = ap.parse_args()

    base = OutboxSettings()
    dbname = f"bench_relay_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(_dsn(base, "postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    settings = base.model_copy(
        update={
            "database_url": type(base.database_url)(
                make_url(base.database_url.get_secret_value())
                .set(database=dbname)
                .render_as_string(hide_password=False)
            )
        }
    )
    logs = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    results: dict[str, object] = {}
    try:
        migrate.upgrade(settings)
        if args.kafka_security:
            secured = with_kafka_from(settings, args.kafka_security)
            results = dict(compare_security(settings, secured, args.rows, args.partitions, logs))
            print(json.dumps(results))
            return
        topic = asyncio.run(create_topic(settings, args.partitions))
        print(
            f"load: {os.cpu_count()} cores, loadavg {os.getloadavg()[0]:.2f}; "
            f"backlog {args.rows} rows of ~300 B, {KEYS} keys, {args.partitions} partitions"
        )
        ceiling, plain = db_ceiling(settings, topic, args.rows)
        print(
            f"raw DB ceiling (relay claim stmt, no Kafka): {ceiling:,.0f} rows/s"
            f"  | plain DELETE..SKIP LOCKED: {plain:,.0f} rows/s"
        )
        naive = asyncio.run(naive_relay(settings, topic, args.naive_rows))
        print(f"naive relay (select 100, send_and_wait, delete each): {naive:,.0f} events/s")
        rates = {}
        for n in (int(x) for x in args.relays.split(",")):
            rates[n] = drain_with_relays(settings, topic, args.rows, n, logs)
            print(
                f"{n} relay process(es): {rates[n]:,.0f} events/s  "
                f"({rates[n] / naive:.1f}x naive, {rates[n] / ceiling:.0%} of DB ceiling)"
            )
        p50, p99, count = asyncio.run(latency(settings, args.rate, args.latency_seconds, logs))
        print(
            f"commit-to-append latency (broker LogAppendTime) at {args.rate} events/s "
            f"({count} events, 1 relay): p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )
        cost = notify_cost(settings, 8, 5)
        if cost:
            print(
                f"producer commits/s, 8 clients: no trigger {cost[0]:,.0f}, NOTIFY trigger "
                f"{cost[1]:,.0f} ({cost[1] / cost[0] - 1:+.0%})"
            )
        results = {
            "ceiling": ceiling,
            "plain_delete": plain,
            "naive": naive,
            "relays": rates,
            "p50_ms": p50,
            "p99_ms": p99,
            "notify": cost,
        }
        print(json.dumps(results, default=str))
    finally:
        with psycopg.connect(_dsn(base, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        if statistics and logs.exists():
            shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()

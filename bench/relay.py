"""Relay benchmark: throughput of 1, 2 and 4 relay processes draining a backlog, against
a naive relay and the raw database ceiling measured in the same run; commit-to-append
latency at a steady rate; and the cost of a NOTIFY trigger on producer commits.

    python -m bench.relay                       # defaults: 200,000 rows, ~2-3 minutes
    python -m bench.relay --rows 50000 --relays 1,2
    python -m bench.relay --rows 50000 --kafka-security secure.env   # SASL_SSL vs plaintext
    python -m bench.relay --rows 100000 --vs ../old/.venv/bin/outbox  # this build vs another
    python -m bench.relay --held-snapshot 180   # a long snapshot: ~10 minutes
    python -m bench.relay --source table,wal --pairs 3   # the sources, and Kafka's own producer

Drain rates are printed beside Kafka's own producer (``ProducerPerformance``, Java, into the
same broker with the same partitions and record count: bench/kafka_perf.py) unless
``--no-kafka-baseline``.

``--held-snapshot SECONDS`` only measures what a long transaction holding a snapshot does
to one relay: the same steady stream (``--rate``, default 2,000 events/s) for SECONDS
without and then SECONDS with a connection in REPEATABLE READ holding an xid, latency over
the last 20 s of each; then the ``--rows`` backlog drained by one relay without and with a
held snapshot. Targets (issue 19): p99 with the snapshot within 2x of p99 without, the drain
with it at >= 80% of the rate without.

``--kafka-security FILE`` only compares one relay draining the backlog over the plaintext
settings of the environment and over the Kafka settings in FILE (a dotenv file with
OUTBOX_KAFKA_BOOTSTRAP_SERVERS and OUTBOX_KAFKA__*, e.g. the SASL_SSL listener of
``scripts/services``: see docs/benchmarks.md).

Needs the services of ``scripts/services up`` (or OUTBOX_DATABASE_URL and
OUTBOX_KAFKA_BOOTSTRAP_SERVERS). Works in a fresh database that it drops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Iterator
from pathlib import Path

import psycopg
from aiokafka import TopicPartition
from dotenv import dotenv_values
from sqlalchemy.engine import make_url

from bench import kafka_perf, tracing, wal
from bench.common import create_topic, delete_topics, relay_env
from outbox import Outbox, migrate
from outbox.db import sync_engine
from outbox.envelope import Message, lane_for
from outbox.kafka.clients import kafka_consumer, kafka_producer
from outbox.settings import KafkaSettings, OutboxSettings
from relay.sources.table.cursor import LANE_START
from relay.sources.table.store import CLAIM_SESSION_SETTINGS, ClaimStore

KEYS = 1000
PAD = 250  # JSON payload of ~300 bytes
LATENCY_WINDOW = 20.0  # held-snapshot run: seconds at the end of each phase measured


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


def own_outbox() -> str:
    exe = Path(sys.executable).with_name("outbox")
    return str(exe) if exe.exists() else "outbox"


def start_relays(
    settings: OutboxSettings, n: int, logs: Path, exe: str | None = None
) -> list[subprocess.Popen[bytes]]:
    command = [exe or own_outbox()]
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


def start_relay(settings: OutboxSettings, logs: Path, name: str) -> subprocess.Popen[bytes]:
    """One relay at INFO (its start-up lines say when it is ready), its log in ``name``."""
    return subprocess.Popen(
        [own_outbox(), "relay"],
        env=relay_env(settings),
        stdout=(logs / name).open("wb"),
        stderr=subprocess.STDOUT,
    )


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


@contextlib.contextmanager
def held_snapshot(settings: OutboxSettings) -> Iterator[None]:
    """A connection in REPEATABLE READ holding an xid (a report, an idle session, pg_dump):
    VACUUM can remove no row deleted or updated while it lasts."""
    with psycopg.connect(settings.libpq_dsn, application_name="bench-held-snapshot") as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT txid_current()")
        try:
            yield
        finally:
            conn.rollback()


def drain_with_relays(
    settings: OutboxSettings, topic: str, rows: int, n: int, logs: Path, exe: str | None = None
) -> float:
    """Events/s of ``n`` relay processes draining a ``rows`` backlog. The relays are
    started and balanced first; the backlog appears in one commit and the clock runs from
    that commit until the outbox is empty (process start-up is not measured)."""
    procs = start_relays(settings, n, logs, exe)
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


def drain_held(
    settings: OutboxSettings, topic: str, partitions: int, rows: int, logs: Path, held: bool
) -> float:
    """Events/s of one relay draining ``rows``, with or without a snapshot held from before
    the backlog until it is drained. The clock stops when Kafka's end offsets have grown by
    ``rows``: counting pending rows would itself walk every dead row of a held snapshot."""
    procs = start_relays(settings, 1, logs)
    try:
        wait_balanced(settings, 1)
        return asyncio.run(_drain_held(settings, topic, partitions, rows, held))
    finally:
        stop_relays(procs)


async def _drain_held(
    settings: OutboxSettings, topic: str, partitions: int, rows: int, held: bool
) -> float:
    consumer = kafka_consumer(settings, enable_auto_commit=False)
    await consumer.start()
    parts = [TopicPartition(topic, p) for p in range(partitions)]

    async def appended() -> int:
        return sum((await consumer.end_offsets(parts)).values())

    try:
        start = await appended()
        with held_snapshot(settings) if held else contextlib.nullcontext():
            t0 = fill(settings, topic, rows, analyze=False)
            while await appended() - start < rows:
                if time.perf_counter() > t0 + 600:
                    raise RuntimeError(f"the relay did not drain {rows} rows in 600 s")
                await asyncio.sleep(0.05)
            return rows / (time.perf_counter() - t0)
    finally:
        await consumer.stop()


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
    store = ClaimStore.of(settings)
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
                        order = lanes[rot:] + lanes[:rot]
                        cur.execute(store.fence, {"lanes": order})
                        cur.execute(
                            store.claim,
                            {
                                "lanes": order,
                                "after": [LANE_START] * len(order),
                                "limit": 2000,
                                "max_bytes": settings.relay.max_inflight_bytes,
                            },
                        )
                    else:
                        cur.execute(plain)  # type: ignore[arg-type]
                    got = len(cur.fetchall())
                if not got:
                    break
                done += got
            results.append(done / (time.perf_counter() - t0))
    return results[0], results[1]


async def steady(
    settings: OutboxSettings, topic: str, rate: int, seconds: float, committed: dict[str, float]
) -> float:
    """Publish ``rate`` events/s for ``seconds``, recording each one's commit time (wall
    clock, as the broker's LogAppendTime) in ``committed``; returns the rate achieved."""
    ob = Outbox(settings)
    engine = sync_engine(settings)
    start = len(committed)
    try:
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
    finally:
        engine.dispose()
    return (len(committed) - start) / seconds


def percentiles(
    committed: dict[str, float], appended: dict[str, int], since: float = 0.0
) -> tuple[float, float, int]:
    """p50/p99 ms from commit to append of the events committed at or after ``since``."""
    lat = sorted(
        appended[eid] / 1000 - at
        for eid, at in committed.items()
        if at >= since and eid in appended
    )
    return lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000, len(lat)


async def latency(
    settings: OutboxSettings, rate: int, seconds: float, logs: Path
) -> tuple[float, float, int]:
    """p50/p99 ms from producer commit to the broker's append (LogAppendTime) at ``rate``
    single-event transactions per second, one relay running."""
    topic = await create_topic(settings, 6, {"message.timestamp.type": "LogAppendTime"})
    procs = start_relays(settings, 1, logs)
    committed: dict[str, float] = {}
    try:
        await asyncio.sleep(3)  # let the relay connect and own its lanes
        await steady(settings, topic, rate, seconds, committed)
        records = await read_topic(settings, topic, len(committed))
    finally:
        stop_relays(procs)
    return percentiles(committed, dict(records))


def dead_rows(settings: OutboxSettings) -> int:
    """The outbox's dead row versions as PostgreSQL's statistics count them."""
    with psycopg.connect(settings.libpq_dsn) as conn:
        row = conn.execute(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
            (settings.db_schema, f"{settings.table_prefix}events"),
        ).fetchone()
    return int(row[0]) if row else 0


async def held_latency(
    settings: OutboxSettings, rate: int, seconds: float, window: float, logs: Path
) -> dict[str, float]:
    """One relay, one steady stream: ``seconds`` without a held snapshot, then ``seconds``
    with one; commit-to-append p50/p99 over the last ``window`` seconds of each."""
    topic = await create_topic(settings, 6, {"message.timestamp.type": "LogAppendTime"})
    procs = start_relays(settings, 1, logs)
    free: dict[str, float] = {}
    held: dict[str, float] = {}
    try:
        await asyncio.sleep(3)  # let the relay connect and own its lanes
        free_rate = await steady(settings, topic, rate, seconds, free)
        free_end = time.time()
        free_load = os.getloadavg()[0]
        with held_snapshot(settings):
            held_rate = await steady(settings, topic, rate, seconds, held)
            held_end = time.time()
            held_load = os.getloadavg()[0]
            dead = dead_rows(settings)
        appended = dict(await read_topic(settings, topic, len(free) + len(held)))
    finally:
        stop_relays(procs)
    p50, p99, n = percentiles(free, appended, free_end - window)
    h50, h99, hn = percentiles(held, appended, held_end - window)
    print(
        f"steady {free_rate:,.0f} events/s, 1 relay, latency over the last {window:.0f} s of "
        f"each {seconds:.0f} s phase:\n"
        f"  no snapshot held:        p50 {p50:6.1f} ms, p99 {p99:6.1f} ms ({n} events, "
        f"loadavg {free_load:.2f})\n"
        f"  snapshot held {seconds:.0f} s:    p50 {h50:6.1f} ms, p99 {h99:6.1f} ms ({hn} events, "
        f"{held_rate:,.0f} events/s, ~{dead:,} dead rows, loadavg {held_load:.2f})\n"
        f"  p99 held / p99 free: {h99 / p99:.2f} (target <= 2)"
    )
    return {"p50_ms": p50, "p99_ms": p99, "held_p50_ms": h50, "held_p99_ms": h99}


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


def compare_builds(
    settings: OutboxSettings, other: str, rows: int, partitions: int, pairs: int, logs: Path
) -> list[float]:
    """One relay of this build and one of ``other`` (an ``outbox`` executable) drain the
    same backlog in turn, ``pairs`` times (who goes first alternates); returns this/other
    per adjacent pair."""
    ratios = []
    builds = [("this", own_outbox()), ("other", other)]
    for i in range(pairs):
        rates = {}
        for name, exe in builds if i % 2 == 0 else builds[::-1]:
            topic = asyncio.run(create_topic(settings, partitions))
            rates[name] = drain_with_relays(settings, topic, rows, 1, logs, exe)
            print(
                f"pair {i + 1} {name:5s} ({exe}): {rates[name]:,.0f} events/s "
                f"(loadavg {os.getloadavg()[0]:.2f})"
            )
        ratios.append(rates["this"] / rates["other"])
        print(f"pair {i + 1} this/other: {ratios[-1]:.2f}")
    print(f"this/other per pair: {', '.join(f'{r:.2f}' for r in ratios)}")
    return ratios


def held_snapshot_run(
    settings: OutboxSettings, args: argparse.Namespace, logs: Path
) -> dict[str, float]:
    """What a snapshot held meanwhile does to one relay: latency, then backlog drain."""
    print(f"load: {os.cpu_count()} cores, loadavg {os.getloadavg()[0]:.2f}")
    results = asyncio.run(
        held_latency(settings, args.rate or 2000, args.held_snapshot, LATENCY_WINDOW, logs)
    )
    topic = asyncio.run(create_topic(settings, args.partitions))
    for held in (False, True):
        rate = drain_held(settings, topic, args.partitions, args.rows, logs, held)
        results["drain_held" if held else "drain"] = rate
        print(
            f"{args.rows} backlog, 1 relay, {'snapshot held' if held else 'no snapshot'}: "
            f"{rate:,.0f} events/s (loadavg {os.getloadavg()[0]:.2f})"
        )
    print(f"drain held / free: {results['drain_held'] / results['drain']:.2f} (target >= 0.8)")
    return results


def held_snapshot_wal(
    settings: OutboxSettings, args: argparse.Namespace, logs: Path
) -> dict[str, float]:
    """The held-snapshot run on the WAL source: latency at a steady rate without and with
    a snapshot held, then the backlog drained without and with one."""
    print(f"load: {os.cpu_count()} cores, loadavg {os.getloadavg()[0]:.2f}; source wal")
    results = asyncio.run(
        held_latency(settings, args.rate or 2000, args.held_snapshot, LATENCY_WINDOW, logs)
    )
    for held in (False, True):
        rate = wal.drain(
            settings,
            start_relay,
            wal.fill_wal,
            args.partitions,
            args.rows,
            logs,
            held_snapshot(settings) if held else None,
        )
        results["drain_held" if held else "drain"] = rate
        print(
            f"{args.rows} backlog, 1 WAL relay, {'snapshot held' if held else 'no snapshot'}: "
            f"{rate:,.0f} events/s (loadavg {os.getloadavg()[0]:.2f})"
        )
    print(f"drain held / free: {results['drain_held'] / results['drain']:.2f} (target >= 0.8)")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--relays", default="1,2,4")
    ap.add_argument("--naive-rows", type=int, default=5_000)
    ap.add_argument("--rate", type=int, help="steady events/s [1000; 2000 with --held-snapshot]")
    ap.add_argument("--latency-seconds", type=float, default=10)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument(
        "--held-snapshot",
        type=float,
        metavar="SECONDS",
        help="only measure a held snapshot: steady stream and backlog, without and with one",
    )
    ap.add_argument(
        "--kafka-security",
        type=Path,
        metavar="ENV_FILE",
        help="only compare 1 relay over plaintext vs the Kafka settings in ENV_FILE",
    )
    ap.add_argument(
        "--vs",
        metavar="OUTBOX",
        help="only compare 1 relay of this build against another build's `outbox` "
        "executable draining the same backlog, alternately, --pairs times",
    )
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--source",
        help="only compare the relay's sources draining the same backlog, one relay each, "
        "alternately, --pairs times: table, wal or table,wal (with --held-snapshot: the "
        "held-snapshot run on that source); see bench/wal.py",
    )
    ap.add_argument(
        "--no-kafka-baseline",
        action="store_true",
        help="skip Kafka's own producer (ProducerPerformance, bench/kafka_perf.py) as the "
        "baseline of the drain rates",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --source: sample each relay's CPU while it drains (bench/cpuprofile.py) and "
        "print where it went, per event",
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
        if args.vs:
            ratios = compare_builds(settings, args.vs, args.rows, args.partitions, args.pairs, logs)
            print(json.dumps({"this_over_other": ratios}))
            return
        if args.kafka_security:
            secured = with_kafka_from(settings, args.kafka_security)
            results = dict(compare_security(settings, secured, args.rows, args.partitions, logs))
            print(json.dumps(results))
            return
        if args.source and args.held_snapshot:
            with wal.wal_mode(settings) as own:
                print(json.dumps(held_snapshot_wal(own, args, logs)))
            return
        if args.source:
            sources = args.source.split(",")
            print(
                f"load: {os.cpu_count()} cores, loadavg {os.getloadavg()[0]:.2f}; "
                f"backlog {args.rows} events of ~300 B, {KEYS} keys, {args.partitions} partitions"
            )
            starter = wal.profiled_relay if args.profile else start_relay
            classpath = None if args.no_kafka_baseline else kafka_perf.tools_classpath()
            medians = wal.compare(
                settings,
                starter,
                fill,
                sources,
                args.partitions,
                args.rows,
                args.pairs,
                logs,
                classpath,
            )
            print(json.dumps(medians))
            return
        if args.held_snapshot:
            print(json.dumps(held_snapshot_run(settings, args, logs)))
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
        kafka = None
        if not args.no_kafka_baseline:
            classpath = kafka_perf.tools_classpath()
            kafka = kafka_perf.producer_performance(settings, args.partitions, args.rows, classpath)
            print(f"Kafka's own producer (ProducerPerformance): {kafka:,.0f} records/s")
        rates = {}
        for n in (int(x) for x in args.relays.split(",")):
            rates[n] = drain_with_relays(settings, topic, args.rows, n, logs)
            of_kafka = f", {rates[n] / kafka:.0%} of Kafka's own producer" if kafka else ""
            print(
                f"{n} relay process(es): {rates[n]:,.0f} events/s  "
                f"({rates[n] / naive:.1f}x naive, {rates[n] / ceiling:.0%} of DB ceiling"
                f"{of_kafka})"
            )
        rate = args.rate or 1000
        p50, p99, count = asyncio.run(latency(settings, rate, args.latency_seconds, logs))
        print(
            f"commit-to-append latency (broker LogAppendTime) at {rate} events/s "
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
            "kafka_producer": kafka,
            "p50_ms": p50,
            "p99_ms": p99,
            "notify": cost,
        }
        print(json.dumps(results, default=str))
    finally:
        with psycopg.connect(_dsn(base, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        asyncio.run(delete_topics(base))
        if statistics and logs.exists():
            shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Inbox consumer throughput and latency.

    python -m bench.consumer [--events 40000] [--partitions 8] [--latency-seconds 15]

1. Throughput: ``--events`` CloudEvents records (~300 B JSON) are produced to a fresh topic
   first, then one consumer drains them with inbox dedupe and a handler inserting one row,
   in batch mode (one transaction per partition batch) and, for comparison, in
   one-transaction-per-event mode (on a smaller slice, it is much slower).
2. Latency at a steady 1,000 events/s: Kafka produce -> handler commit (the moment the
   database commit returned, before the offset commit), p50/p99. The relay is not in the
   path: add the relay's own produce latency for producer-commit -> handler-commit.
"""

# ruff: noqa: ASYNC110  (the bench polls counters on purpose)

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from bench.common import drop_schema, payload_300b, scratch_settings
from inbox import ConsumerDaemon, Metrics
from outbox.db import sync_engine
from outbox.settings import ConsumerSettings, OutboxSettings

KAFKA_OPTIONS: dict[str, Any] = {}


class TimedDaemon(ConsumerDaemon):
    """Records when each partition's database commits returned (bench instrumentation)."""

    commits: list[tuple[TopicPartition, int, float]]

    def _offset_done(self, tp: TopicPartition, offset: int) -> None:
        self.commits.append((tp, offset, time.perf_counter()))
        super()._offset_done(tp, offset)


async def make_topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-inbox-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


def record(n: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    headers = [
        ("ce_id", str(uuid.uuid4()).encode()),
        ("ce_type", b"order.created"),
        ("ce_source", b"urn:bench"),
        ("ce_specversion", b"1.0"),
        ("content-type", b"application/json"),
    ]
    return f"cus-{n % 997}".encode(), json.dumps(payload_300b(n)).encode(), headers


async def produce_all(bootstrap: str, topic: str, n: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=10)
    await producer.start()
    try:
        futures = []
        for i in range(n):
            key, value, headers = record(i)
            futures.append(await producer.send(topic, value, key=key, headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def make_app(name: str, topic: str, table: str) -> inbox.Consumer:
    app = inbox.Consumer(name=name, topics=[topic], kafka_options=KAFKA_OPTIONS)
    insert = text(f"INSERT INTO {table} (order_id, total_cents) VALUES (:o, :t)")

    @app.handler("order.created")
    async def order_created(event: inbox.InboxEvent, session: AsyncSession) -> None:
        body = json.loads(event.value or b"{}")
        await session.execute(insert, {"o": body["order_id"], "t": body["total_cents"]})

    return app


async def drain(settings: OutboxSettings, topic: str, table: str, n: int) -> tuple[float, int]:
    app = make_app(f"bench-{uuid.uuid4().hex[:6]}", topic, table)
    metrics = Metrics(app.name)
    daemon = ConsumerDaemon(app, settings, metrics)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    started: float | None = None
    while metrics.counts["processed"] < n:
        if task.done():
            await task
        if started is None and metrics.counts["processed"] > 0:
            started = time.perf_counter()
            first = metrics.counts["processed"]
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - (started or time.perf_counter())
    stop.set()
    await task
    return elapsed, n - first


async def latency(
    settings: OutboxSettings, table: str, partitions: int, seconds: float, rate: int
) -> list[float]:
    bootstrap = settings.kafka_bootstrap_servers
    topic = await make_topic(bootstrap, partitions)
    app = make_app(f"bench-lat-{uuid.uuid4().hex[:6]}", topic, table)
    daemon = TimedDaemon(app, settings, Metrics(app.name))
    daemon.commits = []
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    while not (daemon._kafka and daemon._kafka.assignment()):
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    sent: dict[tuple[int, int], float] = {}

    async def one(i: int) -> None:
        key, value, headers = record(i)
        t0 = time.perf_counter()
        meta = await (await producer.send(topic, value, key=key, headers=headers))
        sent[(meta.partition, meta.offset)] = t0

    total = int(seconds * rate)
    begin = time.perf_counter()
    pending = []
    for i in range(total):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(asyncio.create_task(one(i)))
    await asyncio.gather(*pending)
    await producer.stop()
    while len(daemon.commits) == 0 or sum(1 for _ in sent) > _covered(daemon.commits, sent):
        await asyncio.sleep(0.05)
    stop.set()
    await task
    # A commit at (partition, offset) finishes every record below offset not yet finished.
    done_at: dict[tuple[int, int], float] = {}
    by_partition: dict[int, list[tuple[int, float]]] = {}
    for tp, offset, at in daemon.commits:
        by_partition.setdefault(tp.partition, []).append((offset, at))
    for p, off in sent:
        done_at[(p, off)] = min(at for o, at in by_partition.get(p, []) if o > off)
    return sorted((done_at[k] - sent[k]) * 1000 for k in sent)


def _covered(
    commits: list[tuple[TopicPartition, int, float]], sent: dict[tuple[int, int], float]
) -> int:
    high: dict[int, int] = {}
    for tp, offset, _ in commits:
        high[tp.partition] = max(high.get(tp.partition, 0), offset)
    return sum(1 for (p, off) in sent if off < high.get(p, 0))


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def main(args: argparse.Namespace) -> None:
    if args.fetch_max_wait_ms is not None:
        KAFKA_OPTIONS["fetch_max_wait_ms"] = args.fetch_max_wait_ms
    base = scratch_settings()
    table = "bench_orders"
    engine = sync_engine(base)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {base.db_schema}.{table} (id bigserial PRIMARY KEY, "
                "order_id text NOT NULL, total_cents int NOT NULL)"
            )
        )
    engine.dispose()
    # The handler's unqualified table name resolves through search_path.
    settings = base.model_copy(update={"database_url": base.database_url})
    results: dict[str, Any] = {}
    try:
        from sqlalchemy import event as sa_event  # noqa: F401  (search_path via options)

        url = settings.sqlalchemy_url.update_query_dict(
            {"options": f"-csearch_path={settings.db_schema}"}
        )
        settings = settings.model_copy(
            update={"database_url": type(settings.database_url)(url.render_as_string(False))}
        )
        bootstrap = settings.kafka_bootstrap_servers
        for mode, n in (("batch", args.events), ("event", args.events_per_event_mode)):
            s = settings.model_copy(update={"consumer": ConsumerSettings(transaction_per=mode)})
            topic = await make_topic(bootstrap, args.partitions)
            await produce_all(bootstrap, topic, n)
            elapsed, counted = await drain(s, topic, table, n)
            results[mode] = counted / elapsed
            print(
                f"throughput, one transaction per {mode:5}: {counted / elapsed:9,.0f} events/s "
                f"({counted:,} events in {elapsed:.2f} s, {args.partitions} partitions)"
            )
        print(f"batch / per-event ratio: {results['batch'] / results['event']:.1f}x")
        lat = await latency(settings, table, args.partitions, args.latency_seconds, args.rate)
        print(
            f"latency at {args.rate}/s for {args.latency_seconds:.0f} s "
            f"(Kafka produce -> handler DB commit, {len(lat):,} events): "
            f"p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms, "
            f"max {lat[-1]:.1f} ms, mean {statistics.fmean(lat):.1f} ms"
        )
    finally:
        drop_schema(base)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--events-per-event-mode", type=int, default=5_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--latency-seconds", type=float, default=15)
    parser.add_argument("--rate", type=int, default=1_000)
    parser.add_argument("--fetch-max-wait-ms", type=int, default=None)
    asyncio.run(main(parser.parse_args()))

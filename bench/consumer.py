"""Inbox consumer throughput, latency and CPU cost.

    python -m bench.consumer [--events 40000] [--batch-events 100000] [--partitions 8]
                             [--latency-seconds 15]
                             [--parts throughput,latency,e2e] [--linger-ms N]
                             [--profile DIR]

1. Throughput: ``--events`` CloudEvents records (~300 B JSON) are produced to a fresh topic
   first, then one consumer drains them with inbox dedupe and a handler inserting one row:

   * ``orm``: the handler parses a pydantic model and ``session.add()``s one ORM row — the
     idiomatic handler; the batch's rows reach the database in one multi-row INSERT at the
     run's flush;
   * ``execute``: the handler runs one ``INSERT`` statement itself (one round trip per
     event, the handler's own cost);
   * ``batch``: a batch handler (``@app.handler(..., batch=True)``) parses the same
     pydantic model per event and writes the whole list in one multi-row ``INSERT ...
     SELECT FROM unnest(...)``, printed beside ``orm`` with the ratio (``--batch-events``
     of them: it drains fast, and a run shorter than a couple of seconds says little);

   in batch mode (one transaction per partition batch) and, for comparison, in
   one-transaction-per-event mode (on a smaller slice, it is much slower).
2. Latency at a steady ``--rate`` (1,000 events/s): a producer in a *separate process*
   (so it does not compete with the consumer for its event loop) sends paced records;
   latency = Kafka produce call -> the handler's database commit returned (before the
   offset commit), p50/p99, with the consumer's CPU time per event. Both processes read the
   same monotonic clock.
3. End to end at the same rate: the producer process commits outbox rows (one event per
   transaction, ``Outbox.publish``), an ``outbox relay`` subprocess publishes them, and
   latency = producer commit returned -> the handler's database commit returned.

Every part prints the consumer's CPU (user + system of this process, which runs the
consumer) per event and per database transaction (throughput runs also the whole
machine's: PostgreSQL and the broker share its CPUs), and how many events a transaction
carried on average, counted from the inbox rows themselves (distinct ``xmin``), so the
figures mean the same for any version of the consumer code. ``--profile DIR`` samples
where that CPU goes (``bench/cpuprofile.py``) and prints the top entries; the profiler's
own cost is small but take figures from runs without it.

Before/after: this file runs against an older checkout too. Put this ``bench`` directory,
alone, next to nothing else and run it with the old checkout's interpreter (its
``inbox``/``outbox`` are then the ones imported)::

    mkdir -p /tmp/newbench && ln -sfn "$PWD/bench" /tmp/newbench/bench
    (cd /tmp/newbench && /path/to/old/.venv/bin/python -m bench.consumer ...)

Alternate old and new runs (noise here is ±30%); ``--linger-ms`` needs code that has it.
Figures depend heavily on what else runs on the machine: the report prints the load.
"""

# ruff: noqa: ASYNC110  (the bench polls counters on purpose)

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from aiokafka import TopicPartition
from pydantic import BaseModel
from sqlalchemy import BigInteger, Integer, Text, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import inbox
from bench import tracing
from bench.common import create_topic, delete_topics, drop_schema, payload_300b, scratch_settings
from bench.cpuprofile import CpuProfile, Stage
from bench.timeline import Timeline
from inbox import ConsumerDaemon, Metrics
from outbox import aio
from outbox.db import sync_engine
from outbox.kafka.clients import kafka_environment, kafka_producer
from outbox.settings import ConsumerSettings, OutboxSettings

TABLE = "bench_orders"
# --profile DIR: where each part's CPU profile goes (None: not profiled).
PROFILE_DIR: str | None = None
# --timeline: print where each throughput run's wall time went (bench/timeline.py).
TIMELINE = False
# Latency runs send at the target rate for this long before measuring: the first events
# after an idle period meet cold caches and a relay backed off to its longest poll interval.
WARMUP_SECONDS = 1.0


class Base(DeclarativeBase):
    pass


class BenchOrder(Base):
    """The handler's effect row (unqualified: found through the bench's search_path)."""

    __tablename__ = TABLE
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    order_id: Mapped[str] = mapped_column(Text)
    total_cents: Mapped[int] = mapped_column(Integer)


class OrderCreated(BaseModel):
    order_id: str
    customer_id: str
    currency: str
    total_cents: int


class TimedDaemon(ConsumerDaemon):
    """Records when each partition's database commits returned (bench instrumentation)."""

    commits: list[tuple[TopicPartition, int, float]]

    def _offset_done(self, tp: TopicPartition, offset: int) -> None:
        self.commits.append((tp, offset, time.perf_counter()))
        super()._offset_done(tp, offset)


def record(n: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    headers = [
        ("ce_id", str(uuid.uuid4()).encode()),
        ("ce_type", b"order.created"),
        ("ce_source", b"urn:bench"),
        ("ce_specversion", b"1.0"),
        ("content-type", b"application/json"),
    ]
    if tracing.enabled():
        headers.append(("traceparent", tracing.TRACEPARENT.encode()))
    return f"cus-{n % 997}".encode(), json.dumps(payload_300b(n)).encode(), headers


async def produce_all(settings: OutboxSettings, topic: str, n: int) -> None:
    producer = kafka_producer(settings, acks="all", linger_ms=10)
    await producer.start()
    try:
        futures = []
        for i in range(n):
            key, value, headers = record(i)
            futures.append(await producer.send(topic, value, key=key, headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def make_app(
    name: str,
    topic: str,
    handler: str,
    seen: dict[tuple[int, int], tuple[str, int]] | None = None,
) -> inbox.Consumer:
    app = inbox.Consumer(name=name, topics=[topic])
    if seen is not None:
        # End-to-end run: the orm handler, also noting which event sits at which offset
        # (the producer only knows event ids; the commit timings know offsets) and when
        # the broker appended it.

        @app.handler("order.created")
        async def add_and_note(event: inbox.InboxEvent, session: AsyncSession) -> None:
            body = OrderCreated.model_validate_json(event.value or b"{}")
            session.add(BenchOrder(order_id=body.order_id, total_cents=body.total_cents))
            seen[(event.partition, event.offset)] = (event.event_id, event.timestamp_ms or 0)

    elif handler == "orm":

        @app.handler("order.created")
        async def add_row(event: OrderCreated, session: AsyncSession) -> None:
            session.add(BenchOrder(order_id=event.order_id, total_cents=event.total_cents))

    elif handler == "batch":
        rows = text(
            f"INSERT INTO {TABLE} (order_id, total_cents) "
            "SELECT * FROM unnest(CAST(:o AS text[]), CAST(:t AS int[]))"
        )

        @app.handler("order.created", batch=True)
        async def insert_list(orders: list[OrderCreated], session: AsyncSession) -> None:
            await session.execute(
                rows, {"o": [o.order_id for o in orders], "t": [o.total_cents for o in orders]}
            )

    else:
        insert = text(f"INSERT INTO {TABLE} (order_id, total_cents) VALUES (:o, :t)")

        @app.handler("order.created")
        async def execute_insert(event: inbox.InboxEvent, session: AsyncSession) -> None:
            body = json.loads(event.value or b"{}")
            await session.execute(insert, {"o": body["order_id"], "t": body["total_cents"]})

    return app


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_ticks() -> tuple[int, int] | None:
    """(all, idle) CPU ticks of the whole machine so far (Linux ``/proc/stat``; None
    elsewhere): over a window, how busy every process together kept the CPUs — the
    consumer, PostgreSQL, the broker and whatever else runs."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks), ticks[3] + ticks[4]  # idle + iowait


def machine_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPUs busy between two :func:`machine_ticks`."""
    if before is None or after is None or after[0] == before[0]:
        return None
    return 1 - (after[1] - before[1]) / (after[0] - before[0])


# Where a consumer's CPU goes, old code and new alike (qualified names of either version).
STAGES: list[Stage] = [
    (name, frozenset(funcs.split()))
    for name, funcs in (
        ("the bench's own bookkeeping (not the consumer)", "_child_result _until _covered"),
        (
            "Kafka offset commits",
            "ConsumerDaemon._committer ConsumerDaemon.flush_offsets "
            "GroupCoordinator._do_commit_offsets",
        ),
        (
            # StreamReaderProtocol and asyncio.wait callbacks: aiokafka's socket reads and
            # its fetch routine (the database driver uses neither).
            "Kafka fetch (requests, responses, records)",
            "AIOKafkaConsumer.getmany Fetcher._fetch_requests_routine "
            "Fetcher._proc_fetch_request AIOKafkaConnection._read AIOKafkaConnection.send "
            "StreamReaderProtocol.data_received _wait.<locals>._on_completion "
            "Fetcher._create_fetch_waiter.<locals>.<lambda>",
        ),
        ("record decoding (InboxEvent)", "decode"),
        ("claim: BEGIN + inbox INSERT (one round trip)", "InboxStore.begin_and_claim"),
        (
            "attempt markers (own statements)",
            "InboxStore.arm_markers InboxStore.set_marker InboxStore.disarm_marker "
            "InboxStore.marker",
        ),
        (
            "ORM flush + COMMIT (SQLAlchemy unit of work, two round trips)",
            "AsyncSession.flush AsyncSession.commit AsyncSessionTransaction.__aexit__ _commit",
        ),
        ("handler: payload model, ORM object, session.add", "Handler.__call__"),
        ("batch handler: its one multi-row INSERT", "Handler.call_batch"),
        ("batch handler: payload models of the list", "Handler.parse"),
        (
            "batch handler: the list (stale checks, metrics, tracing)",
            "Dispatch.run_batch",
        ),
        (
            "session and connection set-up",
            "AsyncSession.__init__ AsyncSession.connection async_sessionmaker.__call__ "
            "AsyncSession.begin AsyncSession.close AsyncSession.__aexit__ "
            "Connections.take Connections.give",
        ),
        ("per event: dispatch, metrics, tracing", "Dispatch.run_handler"),
        (
            "scheduling (lanes, shared transaction bookkeeping)",
            "_Lane.work _Lane.feed ConsumerDaemon._share process_together transaction "
            "PartitionProcessor.process",
        ),
        ("fetch loop", "ConsumerDaemon._loop"),
        ("database driver wake-ups (psycopg)", "wait_async.<locals>.wakeup"),
    )
]


class Profiled:
    """A CPU-time profile of one measured window (``bench/cpuprofile.py``), when
    ``--profile DIR`` asked for it: printed, and saved as folded stacks in DIR."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.profile: CpuProfile | None = None

    def start(self) -> None:
        if PROFILE_DIR is not None and self.profile is None:
            self.profile = CpuProfile().__enter__()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.__exit__(None, None, None)

    def report(self, events: int, per_transaction: float) -> None:
        if self.profile is None:
            return
        path = os.path.join(PROFILE_DIR or ".", f"{self.name}.collapsed")
        self.profile.save(path)
        report = self.profile.report(events, stages=STAGES, per=round(per_transaction))
        print(f"  profile of this part ({path}): {report}")
        self.profile = None


def events_per_transaction(settings: OutboxSettings, consumer: str) -> float:
    """Handled events per database transaction, read from the database itself (each inbox
    row's ``xmin`` is the transaction that claimed it), so the figure means the same for
    any version of the consumer code."""
    inbox = f'"{settings.db_schema}"."{settings.table_prefix}inbox"'
    engine = sync_engine(settings)
    try:
        with engine.connect() as conn:
            rows, transactions = conn.execute(
                text(
                    f"SELECT count(*), count(DISTINCT xmin::text) FROM {inbox} WHERE consumer = :c"
                ),
                {"c": consumer},
            ).one()
    finally:
        engine.dispose()
    return float(rows) / max(int(transactions), 1)


def cpu_figures(cpu_us_per_event: float, per_transaction: float) -> str:
    return (
        f"consumer CPU {cpu_us_per_event:.0f} us/event, "
        f"{cpu_us_per_event * per_transaction:.0f} us/transaction "
        f"({per_transaction:.1f} events per transaction)"
    )


async def drain(
    settings: OutboxSettings, topic: str, n: int, handler: str
) -> tuple[float, int, float, float, float | None]:
    """(seconds, events counted, consumer CPU seconds) from the first processed event on,
    events per transaction, and the share of the machine's CPUs busy meanwhile."""
    app = make_app(f"bench-{uuid.uuid4().hex[:6]}", topic, handler)
    metrics = Metrics(app.name)
    daemon = ConsumerDaemon(app, settings, metrics)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    started: float | None = None
    cpu0, first = 0.0, 0
    ticks0 = None
    profiled = Profiled(f"throughput-{settings.consumer.transaction_per}-{handler}")
    timeline = Timeline() if TIMELINE else None
    if timeline is not None:
        timeline.install()
    try:
        while metrics.counts["processed"] < n:
            if task.done():
                await task
            if started is None and metrics.counts["processed"] > 0:
                started, cpu0, ticks0 = time.perf_counter(), cpu_seconds(), machine_ticks()
                first = metrics.counts["processed"]
                profiled.start()
                if timeline is not None:
                    timeline.start(daemon)
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - (started or time.perf_counter())
        cpu = cpu_seconds() - cpu0
        busy = machine_share(ticks0, machine_ticks())
        if timeline is not None:
            timeline.stop()
        profiled.stop()
        stop.set()
        await task
    finally:
        if timeline is not None:
            timeline.uninstall()
    if timeline is not None:
        print(timeline.report(n - first))
    per_txn = events_per_transaction(settings, app.name)
    profiled.report(n - first, per_txn)
    return elapsed, n - first, cpu, per_txn, busy


def paced_producer(
    settings: OutboxSettings, topic: str, rate: int, seconds: float, out: Connection
) -> None:
    """Child process: send records at a steady pace for ``WARMUP_SECONDS + seconds``; report
    how many, and {(partition, offset): monotonic send time} of those after the warm-up,
    through ``out``."""

    async def run() -> tuple[int, dict[tuple[int, int], float]]:
        producer = kafka_producer(settings, acks="all", linger_ms=0)
        await producer.start()
        sent: dict[tuple[int, int], float] = {}

        async def one(i: int) -> None:
            key, value, headers = record(i)
            t0 = time.perf_counter()
            meta = await (await producer.send(topic, value, key=key, headers=headers))
            if i >= warm:
                sent[(meta.partition, meta.offset)] = t0

        try:
            warm = int(WARMUP_SECONDS * rate)
            total, begin, pending = warm + int(seconds * rate), time.perf_counter(), []
            for i in range(total):
                delay = begin + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                pending.append(asyncio.create_task(one(i)))
            await asyncio.gather(*pending)
        finally:
            await producer.stop()
        return total, sent

    out.send(asyncio.run(run()))
    out.close()


def outbox_producer(
    url: str, schema: str, topic: str, rate: int, seconds: float, out: Connection
) -> None:
    """Child process: commit one-event transactions at a steady pace for ``WARMUP_SECONDS +
    seconds``; report how many, and {event_id: (monotonic, wall-clock) time the commit
    returned} of those after the warm-up, through ``out``."""
    from sqlalchemy.orm import Session

    from outbox import Outbox

    settings = OutboxSettings(database_url=url, db_schema=schema)  # type: ignore[arg-type]
    # A steady load generator on a healthy local database: no pre-ping round trip per
    # transaction (it would cost this process and PostgreSQL CPU the consumer competes for).
    engine = sync_engine(settings, pool_pre_ping=False)
    ob = Outbox(settings)
    committed: dict[str, tuple[float, float]] = {}
    warm = int(WARMUP_SECONDS * rate)
    total, begin = warm + int(seconds * rate), time.perf_counter()
    for i in range(total):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with Session(engine) as session, session.begin():
            event_id = ob.publish(
                session,
                topic=topic,
                key=f"cus-{i % 997}",
                event_type="order.created",
                payload=payload_300b(i),
            )
        if i >= warm:
            committed[str(event_id)] = (time.perf_counter(), time.time())
    engine.dispose()
    out.send((total, committed))
    out.close()


async def relay_latency(
    settings: OutboxSettings, partitions: int, seconds: float, rate: int
) -> tuple[list[float], list[float]]:
    """Sorted producer-commit -> handler-commit latencies (ms) through a relay process, and
    the sorted relay parts of them (producer commit -> broker append, wall clock ms)."""
    topic = await create_topic(
        settings, partitions, {"message.timestamp.type": "LogAppendTime"}, prefix="bench-inbox"
    )
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    app = make_app(f"bench-e2e-{uuid.uuid4().hex[:6]}", topic, "orm", seen)
    daemon = TimedDaemon(app, settings, Metrics(app.name))
    daemon.commits = []
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {
        "OUTBOX_DATABASE_URL": settings.database_url.get_secret_value(),
        "OUTBOX_DB_SCHEMA": settings.db_schema,
        **kafka_environment(settings),
    }
    relay = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cli", "--log-level", "WARNING", "relay", env=env
    )
    try:
        while not (daemon._kafka and daemon._kafka.assignment()):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # relay lanes acquired, consumer fetching
        args = (settings.database_url.get_secret_value(), settings.db_schema, topic, rate, seconds)
        total, committed = await _child_result(outbox_producer, args, task)
        await _until(lambda: len(seen) >= total, task)
        sent = {where: committed[eid][0] for where, (eid, _) in seen.items() if eid in committed}
        await _until(lambda: _covered(daemon.commits, sent), task)
    finally:
        relay.terminate()
        await asyncio.wait_for(relay.wait(), 30)
        stop.set()
        await task
    relay_part = sorted(
        appended - committed[eid][1] * 1000 for eid, appended in seen.values() if eid in committed
    )
    total = sorted((at - sent[k]) * 1000 for k, at in _finished_at(daemon.commits, sent).items())
    return total, relay_part


async def latency(
    settings: OutboxSettings, partitions: int, seconds: float, rate: int, handler: str
) -> tuple[list[float], float, float]:
    """Sorted latencies (ms), the consumer's CPU microseconds per event and events per
    transaction."""
    topic = await create_topic(settings, partitions, prefix="bench-inbox")
    app = make_app(f"bench-lat-{uuid.uuid4().hex[:6]}", topic, handler)
    daemon = TimedDaemon(app, settings, Metrics(app.name))
    daemon.commits = []
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    while not (daemon._kafka and daemon._kafka.assignment()):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # let the consumer's first fetches settle
    profiled = Profiled(f"latency-{handler}")
    cpu0 = cpu_seconds()
    profiled.start()
    total, sent = await _child_result(paced_producer, (settings, topic, rate, seconds), task)
    await _until(lambda: _covered(daemon.commits, sent), task)
    cpu_per_event = (cpu_seconds() - cpu0) / total * 1e6
    profiled.stop()
    print(
        f"  ({len(sent) / len(daemon.commits):.1f} events per partition per database commit on "
        "average; a shared transaction counts once for each partition it finished)"
    )
    stop.set()
    await task
    done_at = _finished_at(daemon.commits, sent)
    per_txn = events_per_transaction(settings, app.name)
    profiled.report(total, per_txn)
    return sorted((done_at[k] - sent[k]) * 1000 for k in sent), cpu_per_event, per_txn


async def _until(done: Callable[[], bool], task: asyncio.Task[None]) -> None:
    """Wait for ``done()``; if the consumer task ends meanwhile, raise what ended it."""
    while not done():
        if task.done():
            await task
        await asyncio.sleep(0.02)


async def _child_result(
    target: Callable[..., None], args: tuple[Any, ...], task: asyncio.Task[None]
) -> Any:
    """Run ``target(*args, pipe)`` in a spawned process and return what it sends back."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(*args, send))
    child.start()
    send.close()
    await _until(receive.poll, task)
    result = receive.recv()
    child.join()
    return result


def _finished_at(
    commits: list[tuple[TopicPartition, int, float]], sent: dict[tuple[int, int], float]
) -> dict[tuple[int, int], float]:
    """When each sent record's database commit returned: a commit at (partition, offset)
    finishes every record below that offset not yet finished."""
    by_partition: dict[int, list[tuple[int, float]]] = {}
    for tp, offset, at in commits:
        by_partition.setdefault(tp.partition, []).append((offset, at))
    done_at: dict[tuple[int, int], float] = {}
    for p, in_order in by_partition.items():
        # One partition's commits come in offset order: walk both lists once.
        offsets = sorted(off for q, off in sent if q == p)
        i = 0
        for offset, at in in_order:
            while i < len(offsets) and offsets[i] < offset:
                done_at[(p, offsets[i])] = at
                i += 1
    return done_at


def _covered(
    commits: list[tuple[TopicPartition, int, float]], sent: dict[tuple[int, int], float]
) -> bool:
    """Whether every sent record is below a committed offset of its partition."""
    high: dict[int, int] = {}
    for tp, offset, _ in commits:
        high[tp.partition] = max(high.get(tp.partition, 0), offset)
    last: dict[int, int] = {}
    for p, off in sent:
        last[p] = max(last.get(p, -1), off)
    return all(high.get(p, 0) > off for p, off in last.items())


def _describe(config: ConsumerSettings) -> str:
    linger = getattr(config, "linger_ms", None)  # older code has no fetch linger
    return "fetch linger: none" if linger is None else f"fetch linger {linger} ms"


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) / {five:.2f} (5 min) on {os.cpu_count()} CPUs"


async def main(args: argparse.Namespace) -> None:
    if tracing.enabled():
        tracing.setup()
    base = scratch_settings()
    engine = sync_engine(base)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {base.db_schema}.{TABLE} (id bigserial PRIMARY KEY, "
                "order_id text NOT NULL, total_cents int NOT NULL)"
            )
        )
    engine.dispose()
    # The handlers' unqualified table name resolves through search_path.
    url = base.sqlalchemy_url.update_query_dict({"options": f"-csearch_path={base.db_schema}"})
    settings = base.model_copy(
        update={"database_url": type(base.database_url)(url.render_as_string(False))}
    )
    # Consumer settings of every part (the code under test's defaults unless given).
    consumer: dict[str, int] = {}
    if args.linger_ms is not None:
        consumer["linger_ms"] = args.linger_ms
    if args.max_concurrent_partitions is not None:
        consumer["max_concurrent_partitions"] = args.max_concurrent_partitions
    settings = settings.model_copy(update={"consumer": ConsumerSettings(**consumer)})
    results: dict[str, float] = {}
    cpu_per_event: dict[str, float] = {}
    try:
        print(
            f"consumer bench: {args.partitions} partitions, payload ~300 B, "
            f"{_describe(settings.consumer)}, up to "
            f"{settings.consumer.max_concurrent_partitions} transactions at once; {load()}"
        )
        runs = [
            ("batch", "orm", args.events),
            ("batch", "execute", args.events),
            ("event", "orm", args.events_per_event_mode),
        ]
        if args.batch_events:
            runs.insert(1, ("batch", "batch", args.batch_events))
        names = {("batch", "orm"): "orm", ("batch", "batch"): "batch"}
        names |= {("batch", "execute"): "execute", ("event", "orm"): "event"}
        runs = [r for r in runs if names[r[:2]] in args.runs]
        for mode, handler, n in runs if "throughput" in args.parts else []:
            s = settings.model_copy(
                update={"consumer": settings.consumer.model_copy(update={"transaction_per": mode})}
            )
            topic = await create_topic(s, args.partitions, prefix="bench-inbox")
            await produce_all(s, topic, n)
            elapsed, counted, cpu, per_txn, busy = await drain(s, topic, n, handler)
            results[f"{mode}/{handler}"] = counted / elapsed
            cpu_per_event[f"{mode}/{handler}"] = cpu / counted * 1e6
            print(
                f"throughput, one transaction per {mode:5}, handler {handler:7}: "
                f"{counted / elapsed:9,.0f} events/s ({counted:,} events in {elapsed:.2f} s, "
                f"{cpu_figures(cpu / counted * 1e6, per_txn)})"
            )
            if busy is not None:
                # The consumer's share is one part: PostgreSQL and the broker run here too.
                cpus = os.cpu_count() or 1
                print(
                    f"  the whole machine meanwhile: {100 * busy:.0f}% of {cpus} CPUs busy, "
                    f"{busy * cpus * elapsed / counted * 1e6:.0f} us CPU per event (all "
                    "processes)"
                )
        if "batch/orm" in results and "event/orm" in results:
            print(
                "batch / per-event ratio (orm handler): "
                f"{results['batch/orm'] / results['event/orm']:.1f}x"
            )
        if "batch/batch" in results and "batch/orm" in results:
            print(
                "batch handler / per-event orm handler (both one transaction per batch): "
                f"{results['batch/batch'] / results['batch/orm']:.1f}x events/s, "
                f"{cpu_per_event['batch/orm'] / cpu_per_event['batch/batch']:.1f}x less CPU "
                "per event"
            )
        if "latency" in args.parts:
            lat, cpu_us, per_txn = await latency(
                settings, args.partitions, args.latency_seconds, args.rate, args.latency_handler
            )
            print(
                f"latency at {args.rate}/s for {args.latency_seconds:.0f} s, handler "
                f"{args.latency_handler} (Kafka produce -> handler DB commit, {len(lat):,} "
                f"events, producer in its own process): p50 {pct(lat, 0.5):.1f} ms, "
                f"p99 {pct(lat, 0.99):.1f} ms, max {lat[-1]:.1f} ms, "
                f"mean {statistics.fmean(lat):.1f} ms; {cpu_figures(cpu_us, per_txn)}"
            )
        if "e2e" in args.parts:
            e2e, part = await relay_latency(
                settings, args.partitions, args.latency_seconds, args.rate
            )
            print(
                f"end to end at {args.rate}/s for {args.latency_seconds:.0f} s (producer commit "
                f"-> relay -> Kafka -> handler DB commit, {len(e2e):,} events, one relay "
                f"process): p50 {pct(e2e, 0.5):.1f} ms, p99 {pct(e2e, 0.99):.1f} ms, "
                f"max {e2e[-1]:.1f} ms"
            )
            print(
                f"  of which producer commit -> broker append (relay): p50 {pct(part, 0.5):.1f} "
                f"ms, p99 {pct(part, 0.99):.1f} ms (broker timestamps have 1 ms resolution)"
            )
        print(f"after the runs: {load()}")
    finally:
        drop_schema(base)
        await delete_topics(base)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--events-per-event-mode", type=int, default=5_000)
    parser.add_argument(
        "--batch-events",
        type=int,
        default=100_000,
        help="events of the batch-handler throughput run (0: skip it; code without batch "
        "handlers cannot run it)",
    )
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--latency-seconds", type=float, default=15)
    parser.add_argument("--rate", type=int, default=1_000)
    parser.add_argument("--latency-handler", choices=["orm", "execute"], default="orm")
    parser.add_argument(
        "--linger-ms",
        type=int,
        help="OUTBOX_CONSUMER__LINGER_MS for every part (default: the settings' default)",
    )
    parser.add_argument(
        "--max-concurrent-partitions",
        type=int,
        help="OUTBOX_CONSUMER__MAX_CONCURRENT_PARTITIONS for every part (default: the "
        "settings' default): how many transactions run at once",
    )
    parser.add_argument(
        "--parts",
        type=lambda v: set(v.split(",")),
        default={"throughput", "latency", "e2e"},
        help="comma-separated subset of throughput,latency,e2e (default: all)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write a CPU-time profile of each measured window to DIR/<part>.prof and print "
        "its top entries (the profiler slows the consumer: take figures from runs without it)",
    )
    parser.add_argument(
        "--runs",
        type=lambda v: set(v.split(",")),
        default={"orm", "batch", "execute", "event"},
        help="throughput runs, a comma-separated subset of orm,batch,execute,event (default: "
        "all; orm and batch are the batch handler's comparison)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print where each throughput run's wall time went: fetches, transactions in "
        "flight, round trips, the lanes' queues, every process's CPU (bench/timeline.py)",
    )
    args = parser.parse_args()
    PROFILE_DIR = args.profile
    TIMELINE = args.timeline
    aio.run_daemon(main(args))

"""The relay's WAL source against its table source (issue 39), for ``bench.relay``:

    python -m bench.relay --source table,wal          # one relay each, same 200k backlog
    python -m bench.relay --source wal --held-snapshot 60

The same backlog for both: 200,000 events of ~300 B over 1,000 keys. Each relay is started
and ready (owning its lanes / reading the slot), then paused (SIGSTOP) while the backlog
is committed — table: one INSERT of every row; WAL: ``publish_many`` of 100 events per
transaction, as producers write it — and resumed; the clock runs from the resume until
Kafka's end offsets have grown by the backlog. Sources alternate, ``--pairs`` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from aiokafka import TopicPartition

from bench import kafka_perf
from bench.common import create_topic, relay_env
from bench.cpuprofile import CpuProfile
from outbox import Message, Outbox
from outbox.db import sync_engine
from outbox.kafka.clients import kafka_consumer
from outbox.settings import OutboxSettings

KEYS = 1000
PAD = 250
PER_TX = 100


@contextlib.contextmanager
def wal_mode(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    """``settings`` in WAL mode with a publication and slot of this run (dropped after:
    a slot left behind holds WAL on the server for ever)."""
    name = f"bench_{uuid.uuid4().hex[:8]}"
    wal = settings.wal.model_copy(update={"slot": name, "publication": name})
    own = settings.model_copy(update={"source": "wal", "wal": wal})
    with psycopg.connect(own.libpq_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE PUBLICATION "{name}"')
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [name])
    try:
        yield own
    finally:
        with psycopg.connect(own.libpq_dsn, autocommit=True) as conn:
            for _ in range(100):
                try:
                    conn.execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                        " WHERE slot_name = %s",
                        [name],
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.1)
            conn.execute(f'DROP PUBLICATION IF EXISTS "{name}"')


def fill_wal(settings: OutboxSettings, topic: str, rows: int) -> None:
    """``rows`` events as producers in WAL mode write them: ``publish_many`` of ``PER_TX``."""
    ob = Outbox(settings)
    engine = sync_engine(settings)
    try:
        for first in range(0, rows, PER_TX):
            with engine.begin() as conn:
                ob.publish_many(
                    conn,
                    [
                        Message(
                            topic=topic,
                            key=f"k{n % KEYS}",
                            event_type="bench.event",
                            source="urn:bench",
                            payload={"n": n, "pad": "x" * PAD},
                        )
                        for n in range(first, min(first + PER_TX, rows))
                    ],
                )
    finally:
        engine.dispose()


def profiled_relay(settings: OutboxSettings, logs: Path, name: str) -> subprocess.Popen[bytes]:
    """One relay at INFO under the CPU-time profiler (``bench/steady_profile.py``: samples
    from SIGUSR1 to SIGUSR2, written beside its log); :func:`drain` reports them."""
    script = Path(__file__).with_name("steady_profile.py")
    return subprocess.Popen(
        [sys.executable, str(script), str(logs / f"{name}.pickle"), "relay"],
        # Another checkout's relay when PYTHONPATH names one (its bench/ has the profiler).
        env={"PYTHONPATH": str(Path(__file__).parents[1]), **relay_env(settings)},
        stdout=(logs / name).open("wb"),
        stderr=subprocess.STDOUT,
    )


def _report(path: Path, events: int) -> None:
    prof = CpuProfile()
    saved = pickle.loads(path.read_bytes())
    prof.stacks, prof.cpu_seconds = saved["stacks"], saved["cpu_seconds"]
    # Beside the logs, which the benchmark removes: the folded stacks stay for flamegraphs.
    folded = Path(tempfile.gettempdir()) / f"{path.stem}.folded"
    prof.save(str(folded))
    print(f"  profile of the relay ({folded}):", flush=True)
    print(prof.report(events, rows=30), flush=True)


def _ready(logs: Path, name: str, marker: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while marker not in (logs / name).read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"relay not ready within {timeout} s; see {logs / name}")
        time.sleep(0.1)


def drain(
    settings: OutboxSettings,
    start_relay: Callable[[OutboxSettings, Path, str], subprocess.Popen[bytes]],
    fill: Callable[[OutboxSettings, str, int], object],
    partitions: int,
    rows: int,
    logs: Path,
    held: contextlib.AbstractContextManager[None] | None = None,
) -> float:
    """Events/s of one relay of ``settings.source`` draining ``rows`` filled while it was
    paused (see the module's docstring)."""
    topic = asyncio.run(create_topic(settings, partitions))
    name = f"relay-{settings.source}-{uuid.uuid4().hex[:4]}.log"
    proc = start_relay(settings, logs, name)
    try:
        marker = "reading the slot" if settings.source == "wal" else "acquired lanes"
        _ready(logs, name, marker)
        proc.send_signal(signal.SIGSTOP)
        with held or contextlib.nullcontext():
            fill(settings, topic, rows)
            profile = logs / f"{name}.pickle"
            profiled = start_relay is profiled_relay
            rate = asyncio.run(_until_appended(settings, topic, partitions, rows, proc, profiled))
            if profiled:
                proc.send_signal(signal.SIGUSR2)
                deadline = time.monotonic() + 10
                while not profile.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(0.5)  # written whole
                _report(profile, rows)
            return rate
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _until_appended(
    settings: OutboxSettings,
    topic: str,
    partitions: int,
    rows: int,
    proc: subprocess.Popen[bytes],
    profiled: bool = False,
) -> float:
    consumer = kafka_consumer(settings, enable_auto_commit=False)
    await consumer.start()
    parts = [TopicPartition(topic, p) for p in range(partitions)]
    try:
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGCONT)
        if profiled:
            proc.send_signal(signal.SIGUSR1)
        while sum((await consumer.end_offsets(parts)).values()) < rows:
            if time.perf_counter() > t0 + 600:
                raise RuntimeError(f"the relay did not drain {rows} events in 600 s")
            await asyncio.sleep(0.02)
        return rows / (time.perf_counter() - t0)
    finally:
        await consumer.stop()


def compare(
    table: OutboxSettings,
    start_relay: Callable[[OutboxSettings, Path, str], subprocess.Popen[bytes]],
    fill_table: Callable[[OutboxSettings, str, int], object],
    sources: list[str],
    partitions: int,
    rows: int,
    pairs: int,
    logs: Path,
    kafka_classpath: str | None = None,
) -> dict[str, float]:
    """Median events/s per source over ``pairs`` alternating rounds; with
    ``kafka_classpath``, each round also runs Kafka's own producer (bench/kafka_perf.py) and
    the medians are printed as fractions of its median."""
    rates: dict[str, list[float]] = {s: [] for s in sources}
    if kafka_classpath:
        rates["kafka"] = []
    with wal_mode(table) as wal:
        for i in range(pairs):
            for source in rates:
                if source == "kafka":
                    assert kafka_classpath
                    rate = kafka_perf.producer_performance(table, partitions, rows, kafka_classpath)
                elif source == "wal":
                    rate = drain(wal, start_relay, fill_wal, partitions, rows, logs)
                else:
                    rate = drain(table, start_relay, fill_table, partitions, rows, logs)
                rates[source].append(rate)
                unit = "records/s (ProducerPerformance)" if source == "kafka" else "events/s"
                print(
                    f"round {i + 1} {source:5}: {rate:9,.0f} {unit} "
                    f"(loadavg {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    medians = {s: statistics.median(r) for s, r in rates.items()}
    for source, rate in medians.items():
        print(f"median {source:5}: {rate:9,.0f} per s over {pairs} round(s)")
    if "table" in medians and "wal" in medians:
        print(f"wal / table: {medians['wal'] / medians['table']:.2f} (target >= 1.5)")
    if "kafka" in medians:
        for source in sources:
            print(f"{source} / Kafka's own producer: {medians[source] / medians['kafka']:.2f}")
    return medians

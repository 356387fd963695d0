"""Partitions that are caught up are not held back by partitions with a backlog (issue 52).

After a broker's failover the partitions it stalled reach the consumer with seconds of
backlog at once, often more of them than there are processing slots
(``max_concurrent_partitions``, 8). A lane used to keep its slot for up to 4 x
max_batch_records records across transactions, and the shared transaction of the lanes
that were caught up waited for a slot like any lane: the partitions no broker had stalled
waited until a backlog drained (on a loaded host, 57 s behind while the stalled ones were
22 s behind). Here, on the single broker, nine of twelve partitions get 1,500 records each
at once while the other three receive a steady stream: the steady ones must stay within
2 s of their send time throughout the drain, as the per-event handler users run applies
them (``outbox consume``, a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.support.inbox import (
    ce_headers,
    effects_table,
    outbox_cli,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import create_topic

pytestmark = pytest.mark.integration
PARTITIONS = 12
BACKLOGGED = range(9)  # more partitions than the 8 slots
STEADY = range(9, 12)
BACKLOG = 1500  # records per backlogged partition, all at once
RATE = 30  # events/s over the steady partitions
BOUND = 2.0


def _record(partition: int, seq: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    key = f"p{partition}"
    body = json.dumps({"key": key, "seq": seq}).encode()
    return key.encode(), body, ce_headers(f"{key}-{seq}-{uuid.uuid4().hex[:6]}")


async def test_a_backlog_in_most_partitions_does_not_hold_back_the_others(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str
) -> None:
    topic = await create_topic(kafka_bootstrap, partitions=PARTITIONS)
    table = effects_table(engine)
    env = subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=f"c-{uuid.uuid4().hex[:8]}",
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
    )
    consumer = outbox_cli(["consume", "tests.support.inbox_apps:app"], env)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
    await producer.start()
    sent: dict[tuple[str, int], float] = {}  # steady (key, seq) -> send time

    def handled() -> dict[tuple[str, int], float]:
        with engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT key, seq, extract(epoch FROM committed_at) FROM {table}")
            )
            return {(r[0], r[1]): float(r[2]) for r in rows}

    async def steady(stop: asyncio.Event) -> None:
        n, begin = 0, time.monotonic()
        while not stop.is_set():
            partition = STEADY[n % len(STEADY)]
            key, body, headers = _record(partition, n)
            sent[(key.decode(), n)] = time.time()
            await producer.send(topic, body, key=key, partition=partition, headers=headers)
            n += 1
            await asyncio.sleep(max(0.0, begin + n / RATE - time.monotonic()))

    try:
        # Every partition assigned and a first record of each handled: the lanes exist.
        for p in range(PARTITIONS):
            key, body, headers = _record(p, -1)
            await producer.send(topic, body, key=key, partition=p, headers=headers)
        await wait_for(lambda: len(handled()) >= PARTITIONS, timeout=60, what="consumer up")
        stop = asyncio.Event()
        stream = asyncio.create_task(steady(stop))
        await asyncio.sleep(2)  # the quiet figure
        began = time.time()
        batches = [
            await producer.send(topic, body, key=key, partition=p, headers=headers)
            for p in BACKLOGGED
            for key, body, headers in (_record(p, s) for s in range(BACKLOG))
        ]
        await asyncio.gather(*batches)
        backlog = PARTITIONS + len(BACKLOGGED) * BACKLOG

        def drained() -> bool:
            assert consumer.poll() is None, "the consumer exited"
            return len(handled()) >= backlog + len(sent)

        await wait_for(drained, timeout=240, what="the backlog drained")
        stop.set()
        await stream
        await wait_for(lambda: len(handled()) >= backlog + len(sent), timeout=60, what="all")
        drain = max(handled().values()) - began
    finally:
        await producer.stop()
        consumer.send_signal(signal.SIGTERM)
        consumer.wait(60)
    done = handled()
    late = {k: done[k] - at for k, at in sent.items()}
    before = [d for k, d in late.items() if sent[k] < began]
    during = [d for k, d in late.items() if began <= sent[k] <= began + drain]
    buckets: dict[int, float] = {}
    for k, d in late.items():
        b = int((sent[k] - began) // 2) * 2
        buckets[b] = max(buckets.get(b, 0.0), d)
    print(
        "\nsteady partitions by 2-s bucket of send time (s after the backlog: worst): "
        + " ".join(f"{b:+d}:{v:.1f}" for b, v in sorted(buckets.items()))
    )
    print(
        f"steady partitions: before the backlog worst {max(before):.2f} s; while "
        f"{len(BACKLOGGED) * BACKLOG} backlogged records drained ({drain:.1f} s) worst "
        f"{max(during):.2f} s over {len(during)} events"
    )
    assert consumer.returncode == 0
    assert max(during) <= BOUND, (
        f"steady partitions {max(during):.2f} s behind (drain {drain:.1f} s)"
    )

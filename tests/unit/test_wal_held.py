"""relay/sources/wal/held.py and the WAL streams' out-of-order settling: a stalled partition's
events queue in order while the others go on (a fake publisher decides when Kafka
answers)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from relay.event import Event as ClaimedRow
from relay.kafka.planning import key_partition
from relay.metrics import RelayMetrics
from relay.sources.wal.held import WHOLE_TOPIC, HeldPartitions
from relay.sources.wal.streams import KeyStream as _Stream

PARTS = [0, 1, 2, 3, 4, 5]
TOPIC = "orders"


def row(key: str | None, n: int, size: int = 10) -> ClaimedRow:
    """The claimed-row layout (relay/sources/table/store.py): key at 3, payload at 4, ce_id at 5."""
    k = None if key is None else key.encode()
    return (0, 0, TOPIC, k, b"x" * size, f"id-{n}", "t", "s", "ct", "{}", "", 0, b"")


def keys_in(partition: int, count: int) -> list[str]:
    found = [f"k{i}" for i in range(10_000) if key_partition(PARTS, f"k{i}".encode()) == partition]
    return found[:count]


class Kafka:
    """Settles what it is given once ``answer`` is set; records the order of events."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.delivered: list[str] = []
        self.calls = 0
        self.fail: BaseException | None = None

    async def settle(self, rows: list[ClaimedRow]) -> bool:
        self.calls += 1
        await self.answer.wait()
        if self.fail is not None:
            raise self.fail
        self.delivered.extend(r[5] for r in rows)
        return True


METRICS: dict[int, RelayMetrics] = {}


def held(kafka: Kafka, limit: int = 1 << 20) -> tuple[HeldPartitions, list[int]]:
    woken: list[int] = []
    metrics = RelayMetrics()
    h = HeldPartitions(kafka.settle, limit, 2, lambda: woken.append(1), metrics.wal_held)
    METRICS[id(h)] = metrics
    return h, woken


def gauge(h: HeldPartitions) -> float | None:
    """outbox_relay_wal_held_events as /metrics serves it."""
    return METRICS[id(h)].registry.get_sample_value("outbox_relay_wal_held_events")


async def test_a_held_partitions_later_events_queue_behind_it_and_others_do_not() -> None:
    kafka = Kafka()
    h, _ = held(kafka)
    k_p2, other = keys_in(2, 1)[0], keys_in(3, 1)[0]
    assert not h and h.route(row(k_p2, 0)) is None
    done = h.hold((TOPIC, 2), [row(k_p2, 0), row(k_p2, 1)], PARTS)
    assert h and h.route(row(k_p2, 2)) == (TOPIC, 2)
    assert h.route(row(other, 3)) is None  # another partition goes on
    assert h.route(row(None, 4)) is None  # keyless: no order to keep
    assert h.bytes == 20 and gauge(h) == 2
    later = h.hold((TOPIC, 2), [row(k_p2, 2)], PARTS)
    await asyncio.sleep(0)
    assert not done.done() and not later.done()
    kafka.answer.set()
    await asyncio.wait_for(later, 5)
    assert done.done()
    assert kafka.delivered == ["id-0", "id-1", "id-2"]  # in order, two per batch
    assert kafka.calls == 2
    assert h.bytes == 0 and gauge(h) == 0 and not h  # drained: the queue is gone
    assert h.route(row(k_p2, 5)) is None


async def test_an_event_routed_while_the_queue_is_published_goes_after_it() -> None:
    kafka = Kafka()
    h, _ = held(kafka)
    key = keys_in(1, 1)[0]
    first = h.hold((TOPIC, 1), [row(key, 0)], PARTS)
    await asyncio.sleep(0)  # the drain is publishing id-0
    assert kafka.calls == 1
    tp = h.route(row(key, 1))
    assert tp == (TOPIC, 1)
    second = h.hold(tp, [row(key, 1)], None)
    kafka.answer.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert kafka.delivered == ["id-0", "id-1"]


async def test_a_missing_topics_queue_takes_every_later_event_of_the_topic() -> None:
    kafka = Kafka()
    h, _ = held(kafka)
    whole = (TOPIC, WHOLE_TOPIC)
    h.hold(whole, [row("a", 0)], None)
    assert h.route(row("b", 1)) == whole  # any key of the topic
    assert h.route(row(None, 2)) == whole
    other = (*row("a", 3)[:2], "payments", *row("a", 3)[3:])
    assert h.route(other) is None  # other topics go on
    later = h.hold(whole, [row("b", 1), row(None, 2)], None)
    kafka.answer.set()
    await asyncio.wait_for(later, 5)
    assert kafka.delivered == ["id-0", "id-1", "id-2"]
    assert not h


async def test_may_hold_only_rows_of_the_refused_partition() -> None:
    h, _ = held(Kafka())
    (a,), (b,) = keys_in(4, 1), keys_in(5, 1)
    assert h.may_hold(row(a, 0), (TOPIC, 4), PARTS)
    assert not h.may_hold(row(b, 1), (TOPIC, 4), PARTS)  # refused after it, elsewhere
    assert h.may_hold(row(None, 2), (TOPIC, 4), PARTS)
    assert not h.may_hold(row(a, 3), (TOPIC, 4), None)  # partitions unknown: in place


async def test_room_waits_while_held_bytes_exceed_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kafka = Kafka()
    h, _ = held(kafka, limit=15)
    key = keys_in(0, 1)[0]
    h.hold((TOPIC, 0), [row(key, 0), row(key, 1)], PARTS)
    stopping = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="relay.wal"):
        waiting = [asyncio.ensure_future(h.room(stopping)) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        kafka.answer.set()
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert h.bytes == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reading the slot waits for Kafka" in m for m in messages) == 1, messages
    assert sum("fit in relay.max_inflight_bytes again" in m for m in messages) == 1, messages


async def test_room_gives_up_when_stopping() -> None:
    h, _ = held(Kafka(), limit=5)
    h.hold((TOPIC, 0), [row(keys_in(0, 1)[0], 0)], PARTS)
    stopping = asyncio.Event()
    waiting = asyncio.ensure_future(h.room(stopping))
    await asyncio.sleep(0.01)
    stopping.set()
    await asyncio.wait_for(waiting, 5)
    assert h.bytes == 10  # nothing delivered: not confirmed, read again
    await h.close()


async def failed_publishing() -> tuple[HeldPartitions, list[int]]:
    """A queue whose publishing failed (the failed table unreachable, say)."""
    kafka = Kafka()
    kafka.fail = RuntimeError("failed table unreachable")
    h, woken = held(kafka)
    h.hold((TOPIC, 0), [row(keys_in(0, 1)[0], 0)], PARTS)
    kafka.answer.set()
    for _ in range(10):
        await asyncio.sleep(0)
    return h, woken


async def test_a_failure_publishing_held_events_is_raised_by_check() -> None:
    h, woken = await failed_publishing()
    assert woken
    with pytest.raises(RuntimeError, match="unreachable"):
        h.check()
    h.check()  # raised once
    await h.close()


async def test_a_failure_not_raised_before_close_is_not_raised_by_the_next_reading() -> None:
    h, _ = await failed_publishing()
    assert h.failure is not None
    await h.close()  # the reading ended for another reason first
    h.check()


async def test_close_cancels_what_is_still_held() -> None:
    kafka = Kafka()
    h, _ = held(kafka)
    done = h.hold((TOPIC, 0), [row(keys_in(0, 1)[0], 0)], PARTS)
    await asyncio.sleep(0)
    await h.close()
    await asyncio.sleep(0)
    # Never settled: the batch waiting for it is not counted, its position not confirmed.
    assert done.done() and (
        done.cancelled() or isinstance(done.exception(), asyncio.CancelledError)
    )
    assert not h and h.bytes == 0 and gauge(h) == 0


async def test_holding_and_delivering_are_said_once_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kafka = Kafka()
    h, _ = held(kafka)
    key = keys_in(3, 1)[0]
    with caplog.at_level(logging.INFO, logger="relay.wal"):
        h.hold((TOPIC, 3), [row(key, 0)], PARTS)
        h.hold((TOPIC, 3), [row(key, 1)], PARTS)
        kafka.answer.set()
        for _ in range(20):
            await asyncio.sleep(0)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("orders[3] does not answer" in m for m in messages) == 1, messages
    assert sum("its 2 held events are delivered" in m for m in messages) == 1, messages


def test_a_stream_counts_batches_done_only_in_order() -> None:
    stream = _Stream()
    stream.settle(2)  # settled before batch 1, whose events are held
    assert stream.done == 0
    stream.settle(3)
    assert stream.done == 0
    stream.settle(1)
    assert stream.done == 3
    stream.settle(5)  # batch 4 given up (stopping): never counted past it
    assert stream.done == 3

"""Pure parts of the relay: lane rebalancing, error classification, lock namespaces, the
in-flight byte budget, putting rows back in bounded pieces."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiokafka import errors as kerr

from outbox.errors import BrokerUnavailable, ProducerBroken, RecordRejected, TopicMissing
from outbox.kafka.errors import producer_failure
from outbox.settings import OutboxSettings
from relay.errors import RecordTooLarge
from relay.event import ID, PAYLOAD
from relay.kafka.inflight import ByteBudget
from relay.kafka.outcome import Outcome
from relay.sources.table.lanes import rebalance
from relay.store import RESTORE_CHUNK_BYTES, RelayStore, namespaces


def test_alone_a_relay_wants_every_lane_free_ones_first() -> None:
    plan = rebalance(frozenset(), held_any={0, 1}, live=1, lanes=8, rng=random.Random(1))
    assert (plan.share, plan.want, plan.release) == (8, 8, [])
    assert set(plan.candidates[:6]) == set(range(2, 8))
    assert set(plan.candidates[6:]) == {0, 1}


def test_above_share_releases_exactly_the_extras() -> None:
    owned = frozenset(range(64))
    plan = rebalance(owned, held_any=set(range(64)), live=3, lanes=64, rng=random.Random(2))
    assert plan.share == 22
    assert len(plan.release) == 42 and set(plan.release) <= owned
    assert plan.want == 0


@pytest.mark.parametrize("live", [1, 2, 3, 5, 8])
def test_shares_of_all_live_relays_cover_every_lane(live: int) -> None:
    plan = rebalance(frozenset(), set(), live, 64)
    assert plan.share * live >= 64


def test_at_share_does_nothing() -> None:
    plan = rebalance(frozenset(range(32)), set(range(64)), live=2, lanes=64)
    assert (plan.release, plan.candidates, plan.want) == ([], [], 0)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (kerr.MessageSizeTooLargeError(), RecordRejected),
        (kerr.TopicAuthorizationFailedError(), RecordRejected),
        (kerr.InvalidTopicError(), RecordRejected),
        (kerr.OutOfOrderSequenceNumber(), ProducerBroken),
        (kerr.UnknownProducerId(), ProducerBroken),
        (kerr.KafkaConnectionError(), BrokerUnavailable),
        (kerr.NotEnoughReplicasError(), BrokerUnavailable),
        (TimeoutError(), BrokerUnavailable),
        (RecordTooLarge(10, 5), RecordTooLarge),
        (TopicMissing("t"), TopicMissing),
    ],
)
def test_producer_failures_map_onto_the_framework_s_tree(
    exc: Exception, kind: type[Exception]
) -> None:
    assert isinstance(producer_failure(exc), kind)


def test_row_rejections_are_not_transient_but_outages_are() -> None:
    assert Outcome(failed={0: RecordTooLarge(2, 1), 1: TopicMissing("t")}).transient is None
    down = BrokerUnavailable("down")
    assert Outcome(failed={0: RecordTooLarge(2, 1), 1: down}).transient is down
    assert not RecordRejected("x").retriable and BrokerUnavailable("x").retriable


def test_lock_namespaces_are_distinct_positive_and_per_deployment() -> None:
    a = namespaces("public", "outbox_")
    b = namespaces("public", "other_")
    assert len(set(a)) == 3 and all(0 < n < 2**31 for n in a)
    assert set(a).isdisjoint(b)


async def test_the_in_flight_budget_waits_for_kafka_to_answer_earlier_batches() -> None:
    budget = ByteBudget(100)
    first = await budget.acquire(70, within=1)
    assert first == 70
    loop = asyncio.get_running_loop()
    ack: asyncio.Future[None] = loop.create_future()
    budget.hold(ack, 70)  # an outstanding batch keeps its bytes
    assert await budget.acquire(50, within=0.05) is None  # no room: reported, not queued
    waiting = asyncio.create_task(budget.acquire(50, within=5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    ack.set_result(None)  # Kafka answered
    assert await waiting == 50
    assert budget.used == 50
    # One claim larger than the whole budget still goes, alone.
    budget.release(50)
    assert await budget.acquire(1_000, within=0.05) == 100


async def test_a_stalled_delivery_holds_only_its_share_and_a_retired_one_lets_go() -> None:
    budget = ByteBudget(100)
    assert await budget.acquire(90, within=1) == 90
    loop = asyncio.get_running_loop()
    healthy: asyncio.Future[None] = loop.create_future()
    stalled: asyncio.Future[None] = loop.create_future()  # never answered
    budget.hold(healthy, 30)
    budget.hold(stalled, 40)
    budget.release(20)  # rows the plan refused
    assert budget.used == 70
    healthy.set_result(None)
    await asyncio.sleep(0)  # done callbacks run on the loop
    assert budget.used == 40  # the healthy partition's bytes are back
    budget.let_go([stalled])  # its producer was replaced: its rows go again
    assert budget.used == 0
    stalled.cancel()
    await asyncio.sleep(0)
    assert budget.used == 0  # given back once, not twice


def _row(i: int, size: int) -> tuple[object, ...]:
    row: list[object] = [None] * 13
    row[ID], row[PAYLOAD] = i, b"x" * size
    return tuple(row)


def test_claimed_rows_are_put_back_a_few_megabytes_per_statement() -> None:
    mib = 1024 * 1024
    sizes = [3 * mib, 3 * mib, 100, 5 * mib, 1 * mib, 2 * mib]
    rows = [_row(i, size) for i, size in enumerate(sizes)]
    n = len(rows)
    chunks = list(RelayStore.restore_chunks(rows, [1] * n, [None] * n, [0.0] * n))
    assert [c["id"] for c in chunks] == [[0], [1, 2], [3], [4, 5]]
    assert all(sum(map(len, c["payload"])) <= max(RESTORE_CHUNK_BYTES, 5 * mib) for c in chunks)


async def test_a_cancelled_delivery_leaves_no_batch_failure_unread() -> None:
    # SIGTERM after a broker fault: deliveries still waiting were cancelled, then the
    # producer's close failed their queued batches with ProducerClosed, and asyncio printed
    # "Future exception was never retrieved" for each batch nobody awaited any more.
    import gc

    from outbox.kafka.aiokafka_client import AioProducer

    loop = asyncio.get_running_loop()
    unread: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    batches: list[asyncio.Future[None]] = []

    class _Producer:
        async def send_batch(self, builder: object, topic: str, partition: int) -> object:
            batches.append(loop.create_future())
            return batches[-1]

    producer = AioProducer(_Producer(), OutboxSettings())  # type: ignore[arg-type]
    try:
        delivery = asyncio.ensure_future(producer.deliver(("t", 0), [object()] * 3))  # type: ignore[list-item]
        await asyncio.sleep(0)  # queued all three, waiting for the first
        assert len(batches) == 3
        delivery.cancel()
        await asyncio.gather(delivery, return_exceptions=True)
        closed = kerr.ProducerClosed()
        for batch in batches[1:]:  # the first was awaited, so cancelled with the delivery
            batch.set_exception(closed)
        await asyncio.sleep(0)
        del batch, batches[:], delivery
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert unread == []


async def test_a_background_task_that_dies_is_logged_at_error_and_fails_health(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The leader watch, the metadata watch and the offset committer run until cancelled;
    # one that raises used to end unobserved (the leader watch logged at DEBUG).
    import logging

    from outbox.lifecycle import supervise

    died: list[str] = []

    async def broken() -> None:
        raise RuntimeError("a bug")

    async def waiting() -> None:
        await asyncio.sleep(60)

    task, cancelled = asyncio.ensure_future(broken()), asyncio.ensure_future(waiting())
    supervise(task, "leader watch", logging.getLogger("t.watch"), lambda: died.append("task"))
    supervise(cancelled, "committer", logging.getLogger("t.watch"), lambda: died.append("c"))
    cancelled.cancel()
    await asyncio.gather(task, cancelled, return_exceptions=True)
    await asyncio.sleep(0)
    assert died == ["task"]  # cancelled: a normal stop
    (error,) = [r for r in caplog.records if r.name == "t.watch"]
    assert error.levelno == logging.ERROR
    assert "leader watch died" in error.getMessage() and "a bug" in error.getMessage()
    assert error.exc_info is not None  # the traceback, for the bug report


async def test_a_leader_watch_that_dies_fails_the_relays_health_and_is_not_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from relay.kafka.publisher import Publisher
    from relay.sources.table.source import WORDING

    publisher = Publisher.from_settings(OutboxSettings(), WORDING)
    starts: list[int] = []

    async def broken() -> None:
        starts.append(1)
        raise KeyError("leader")  # an answer of a shape this code does not expect

    publisher.watch.run = broken  # type: ignore[method-assign]
    publisher.watch.ensure()
    for _ in range(500):  # a few loop turns; more on a loaded machine
        if publisher.failure is not None:
            break
        await asyncio.sleep(0.01)
    assert publisher.failure is not None  # Relay.healthy() is False
    publisher.watch.ensure()  # the next stall: not restarted into the same bug
    await asyncio.sleep(0.01)
    assert starts == [1]
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "relay leader watch died" in error.getMessage()


def test_the_status_line_names_the_figures_of_the_source_that_runs() -> None:
    # The WAL source has no outbox rows, lanes or claim snapshots: its status line says how
    # far behind the slot is instead (-1 until the gauges are first read).
    from relay import Relay

    table = Relay(OutboxSettings()).status()
    wal = Relay(OutboxSettings(source="wal")).status()
    shared = {"published", "moved_to_failed", "kafka_up", "partitions_unavailable"}
    assert shared | {"pending", "oldest_age_seconds", "owned_lanes"} <= set(table)
    assert set(wal) == shared | {
        "wal_unconfirmed_bytes",
        "wal_lag_seconds",
        "wal_slot_status",
        "wal_held_events",
    }
    assert wal["wal_lag_seconds"] == "unknown" and "pending" not in wal


def test_status_figures_are_integers_and_unknown_while_the_database_is_down() -> None:
    from relay.metrics import RelayMetrics

    metrics = RelayMetrics()
    metrics.pending.set(12)
    metrics.published.inc(3)
    metrics.dead_rows.set(40)
    counts = metrics.status()
    up, down = metrics.vacuum_status(True), metrics.vacuum_status(False)
    pending = metrics.measured("outbox_relay_pending_events", True)
    assert (pending, counts["published"], up["outbox_dead_tuples"]) == (12, 3, 40)
    assert all(type(counts[k]) is int for k in ("published", "kafka_up", "moved_to_failed"))
    assert type(pending) is int
    # A gauge last set before the outage is not a measurement: unknown, never 0 or stale.
    assert metrics.measured("outbox_relay_pending_events", False) == "unknown"
    assert down["outbox_dead_tuples"] == down["oldest_snapshot_seconds"] == "unknown"
    down = metrics.status()
    assert down["published"] == 3  # what this relay counted itself stays known


def test_a_pipeline_woken_for_nothing_again_and_again_polls_without_a_wake_slot_a_while() -> None:
    from relay.sources.table.wakes import FRUITLESS_WAKES, PAUSE_SECONDS, WakePolicy

    wakes = WakePolicy()
    assert wakes.wakeable(0.0)
    # Empty claims after timed sleeps, and wake-ups that found rows, are no reason to stop.
    for t in range(10):
        wakes.claimed(0, False, float(t))
        wakes.claimed(5, True, t + 0.5)
    assert wakes.wakeable(10.0)
    # Wake-ups in a row that found nothing (another relay's lanes had the rows): a pause.
    for i in range(FRUITLESS_WAKES - 1):
        wakes.claimed(0, True, 10.0 + i)
        assert wakes.wakeable(10.0 + i)
    wakes.claimed(0, True, 20.0)
    assert not wakes.wakeable(20.0 + PAUSE_SECONDS / 2)
    assert wakes.wakeable(20.0 + PAUSE_SECONDS)
    # A claim with rows in between starts the count again.
    wakes.claimed(0, True, 30.0)
    wakes.claimed(1, False, 30.1)
    wakes.claimed(0, True, 30.2)
    wakes.claimed(0, True, 30.3)
    assert wakes.wakeable(30.4)

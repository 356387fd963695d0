"""Partition stalls and holds (relay/kafka/partitions.py): pure bookkeeping, a fake clock."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from outbox.kafka.aiokafka_client import AioKafkaClients
from outbox.kafka.client import Broker, ClusterView, PartitionState, PickBroker, ProducerOptions
from outbox.settings import OutboxSettings, RelaySettings
from relay.errors import PartitionUnavailable
from relay.kafka.leader_watch import LEADER_PROBE_SECONDS, UNANSWERED_ACK_TIMEOUTS, LeaderWatch
from relay.kafka.partitions import MAX_DELAY, MIN_DELAY, PartitionHealth
from relay.kafka.publisher import Publisher
from relay.metrics import RelayMetrics
from relay.sources.table.source import WORDING
from relay.sources.wal.source import WORDING as WAL_WORDING

TP = ("orders", 3)
OTHER = ("orders", 4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def health(clock: Clock) -> PartitionHealth:
    return PartitionHealth(RelayMetrics(), WORDING, clock)


def said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The relay's lines only: the test session may have a Kafka client of another test
    still logging (its broker gone)."""
    return [r for r in caplog.records if r.name == "relay.kafka"]


def gauge(health: PartitionHealth) -> float | None:
    return health._metrics.registry.get_sample_value("outbox_relay_partitions_unavailable")


async def test_a_stalled_partition_refuses_its_rows_until_its_batch_is_answered(
    health: PartitionHealth, clock: Clock
) -> None:
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    first = health.stalled(TP, batch, leader=2)
    assert isinstance(first, PartitionUnavailable) and first.delay == MIN_DELAY
    assert str(first).startswith(PartitionUnavailable.MARKER)  # what a take-over looks for
    assert "orders[3]" in str(first) and "leader 2" in str(first)
    assert health.refusal(OTHER, clock.now) is None  # the others keep flowing
    clock.now += 8
    refused = health.refusal(TP, clock.now)
    assert refused is not None and refused.delay == MAX_DELAY  # grows with the stall
    assert health.waiting == [batch]
    batch.set_result(None)
    assert health.answered() == [batch] and health.unavailable == 0


async def test_after_the_stall_rows_wait_until_those_put_back_are_due(
    health: PartitionHealth, clock: Clock
) -> None:
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    health.stalled(TP, batch, leader=2)
    clock.now += 4
    put_back = health.refusal(TP, clock.now)  # 4 s into the stall: delay 0.5 s, due at 104.5
    assert put_back is not None and put_back.delay == pytest.approx(0.5)
    batch.set_result(None)
    health.answered()
    clock.now += 0.2
    # A claim that began before the put-back rows are due may have passed over them: its
    # rows of that partition go back too, due no later than the others.
    late = health.refusal(TP, clock.now - 0.1)
    assert late is not None and late.delay == pytest.approx(0.3)
    assert health.refusal(TP, 104.5) is None  # a claim from then on sees them all


async def test_a_missing_topic_holds_its_later_rows_until_those_put_back_are_due(
    health: PartitionHealth, clock: Clock
) -> None:
    # Rows went back for 5 s because the topic did not exist; it exists a second later.
    # A claim started before they are due did not see them: its rows of the topic wait too.
    health.topic_missing("orders", 5.0)
    clock.now += 1
    refused = health.refusal(TP, clock.now)
    assert isinstance(refused, PartitionUnavailable) and refused.delay == pytest.approx(4.0)
    assert health.refusal(("payments", 0), clock.now) is None  # other topics go on
    clock.now += 4.5
    assert health.refusal(TP, clock.now) is None  # this claim sees them all, in id order


async def test_a_replaced_producer_s_batches_are_forgotten(health: PartitionHealth) -> None:
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    health.stalled(TP, batch, leader=1)
    health.forget([batch])
    assert health.unavailable == 0 and health.waiting == []
    batch.cancel()


async def test_one_line_per_change_and_none_for_a_blip(
    health: PartitionHealth, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "relay.kafka")
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    parts = {"orders": list(range(6))}
    health.stalled(TP, a, leader=2)
    health.report(parts)
    assert said(caplog) == [] and gauge(health) == 1  # counted at once, said after 1 s
    clock.now += 1.5
    health.stalled(OTHER, b, leader=2)
    health.report(parts)
    health.report(parts)
    [line] = said(caplog)
    assert "1 of 6 partitions of orders unavailable since" in line.getMessage()
    assert "leader 2" in line.getMessage() and gauge(health) == 2
    clock.now += 1.5
    health.report(parts)  # the second partition is down long enough now: a new state
    assert "2 of 6 partitions" in said(caplog)[-1].getMessage()
    assert said(caplog)[-1].getMessage().endswith("the other partitions keep flowing")
    a.set_result(None)
    b.set_result(None)
    health.answered()
    health.report(parts)
    assert "available again after 3.0 s" in said(caplog)[-1].getMessage()
    assert len(said(caplog)) == 3 and gauge(health) == 0


async def test_when_every_partition_is_unavailable_no_others_keep_flowing(
    health: PartitionHealth, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "relay.kafka")
    health.stalled(TP, asyncio.get_running_loop().create_future(), leader=1)
    clock.now += 1.5
    health.report({"orders": [3]})
    [line] = said(caplog)
    message = line.getMessage()
    assert message.startswith("1 of 1 partitions of orders unavailable since")
    assert message.endswith("leader 1; their rows wait in the outbox")


async def test_a_wal_relays_stall_line_says_its_events_wait_in_memory(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # The WAL source holds a stalled partition's events in memory (relay/sources/wal/held.py):
    # "rows wait in the outbox" would send an operator to look for them in the table.
    caplog.set_level(logging.WARNING, "relay.kafka")
    health = PartitionHealth(RelayMetrics(), WAL_WORDING, clock)
    health.stalled(TP, asyncio.get_running_loop().create_future(), leader=1)
    clock.now += 1.5
    health.report({"orders": [3]})
    [line] = said(caplog)
    assert line.getMessage().endswith("leader 1; their events wait in memory")


class _Running:
    """What the publisher reads of a running producer: its view of the brokers."""

    def __init__(self, nodes: list[int]) -> None:
        self._brokers = [Broker(n, "10.0.0.1", 9090 + n) for n in nodes]
        self.closed = False

    def brokers(self) -> list[Broker]:
        return self._brokers

    def nodes(self) -> list[int]:
        return [b.node_id for b in self._brokers]

    async def close(self, flush_within: float, in_flight_within: float) -> None:
        self.closed = True


def _publisher(bootstrap: str = "a:1", clients: object | None = None) -> Publisher:
    if clients is None:
        clients = AioKafkaClients(OutboxSettings(kafka_bootstrap_servers=bootstrap))
    return Publisher(RelaySettings(), 1_048_576, clients, WORDING)  # type: ignore[arg-type]


async def test_new_clients_bootstrap_from_brokers_that_answer_and_pick_them() -> None:
    # aiokafka shuffles a bootstrap list, and a hung broker holds a start for a request
    # timeout: once some brokers are known to answer, only they are given.
    publisher = _publisher("a:1,b:2")
    assert publisher.brokers.bootstrap() == "a:1,b:2"  # nothing running yet: the configured list
    running = _Running([1, 2, 3])
    publisher.pool._producers[0] = running  # type: ignore[assignment]
    now = asyncio.get_running_loop().time()
    publisher.brokers.answered = {1: now - 60, 2: now, 3: now}  # broker 1 went quiet long ago
    assert publisher.brokers.bootstrap() == "10.0.0.1:9092,10.0.0.1:9093"
    assert {publisher.brokers.pick_node(running.nodes()) for _ in range(50)} == {2, 3}
    publisher.brokers.answered = {}  # nobody known to answer: every broker, then the configured
    assert publisher.brokers.bootstrap().split(",") == [
        "10.0.0.1:9091",
        "10.0.0.1:9092",
        "10.0.0.1:9093",
        "a:1",
        "b:2",
    ]
    # After a failover Kafka lists only the brokers it has not fenced, and both answer:
    # them alone, not the configured list too (it names the hung broker, and a new producer
    # that tried it first waited for its return).
    publisher.pool._producers[0] = _Running([2, 3])  # type: ignore[assignment]
    publisher.brokers.answered = {2: now, 3: now}
    assert publisher.brokers.bootstrap() == "10.0.0.1:9092,10.0.0.1:9093"


async def test_a_producer_is_in_place_once_its_start_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Between the end of a start and the resumption of those waiting for it, a caller finds
    # no start under way: unless the producer is in place by then, it starts a second one
    # for the same partitions — never kept, so never closed nor replaced when they stall.
    made: list[object] = []

    class _Started:
        async def start(self) -> None:
            await asyncio.sleep(0)

    class _Clients:
        bootstrap = ["a:1"]

        def producer(self, bootstrap: str, options: ProducerOptions, pick: PickBroker) -> object:
            made.append(_Started())
            return made[-1]

    publisher = _publisher(clients=_Clients())
    waiting = asyncio.ensure_future(publisher.pool.start(0))
    await asyncio.sleep(0)  # the start is under way
    in_place: list[object | None] = []
    pool = publisher.pool
    pool._starting[0].add_done_callback(lambda _: in_place.append(pool._producers[0]))
    assert await waiting is made[0]
    assert in_place == [made[0]]  # in place before anyone resumed
    assert await publisher.pool.start(0) is made[0] and len(made) == 1


async def test_when_every_leader_has_a_stalled_partition_the_brokers_that_answer_are_asked() -> (
    None
):
    # Three brokers, replication factor 3, one hung: every partition waits for it, so every
    # broker leads a stalled partition. Those that answered the leader watch lately are
    # still asked; the hung one is not (it would hold a start for a request timeout).
    publisher = _publisher()
    running = _Running([1, 2, 3])
    publisher.pool._producers[0] = running  # type: ignore[assignment]
    loop = asyncio.get_running_loop()
    for partition, leader in enumerate([1, 2, 3]):
        publisher.health.stalled(("orders", partition), loop.create_future(), leader)
    publisher.brokers.answered = {2: loop.time(), 3: loop.time()}
    assert {publisher.brokers.pick_node(running.nodes()) for _ in range(50)} == {2, 3}
    assert publisher.brokers.bootstrap() == "10.0.0.1:9092,10.0.0.1:9093"


async def test_replacing_a_stalled_batch_s_producer_ends_every_wait_for_kafka(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After an outage each pipeline waits for a stalled batch to be answered before it
    # tries Kafka again. A replaced producer's batches are no longer waited for, and may
    # never be answered: the waits end then, not when their backoff runs out.
    publisher = _publisher()
    producer = _Running([1])
    publisher.pool._producers[0] = producer  # type: ignore[assignment]
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    publisher.health.stalled(TP, batch, leader=1)
    publisher._stuck[batch] = producer  # type: ignore[assignment]
    assert not await publisher.wait_answered(0.05)  # nothing answered, nothing replaced
    waits = [asyncio.ensure_future(publisher.wait_answered(30.0)) for _ in range(2)]
    await asyncio.sleep(0.01)
    before = asyncio.get_running_loop().time()
    publisher._replace(producer, "its partition has a new leader")  # type: ignore[arg-type]
    # A pipeline that last tried before this tries again at once, waiting or not.
    assert publisher.replaced_at >= before
    assert await asyncio.wait_for(asyncio.gather(*waits), 1.0) == [True, True]
    assert publisher.health.waiting == [] and publisher.pool._producers[0] is None
    await asyncio.sleep(0)
    assert producer.closed


async def test_the_leader_watch_outlives_a_client_that_cannot_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The watch starts as a hang begins, when the hung broker may still count as answering
    # and be the one its client asks. Its start then fails, and the watch tries again at
    # its next probe instead of stopping (it stopped in hang test runs, and the hung
    # broker's partitions waited out their request timeout after Kafka's failover).
    starts: list[float] = []

    async def no_client(self: LeaderWatch) -> None:
        starts.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(LeaderWatch, "client", no_client)
    publisher = _publisher()
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    publisher.health.stalled(TP, batch, leader=1)
    watch = asyncio.ensure_future(publisher.watch.run())
    await asyncio.sleep(4 * LEADER_PROBE_SECONDS)
    assert len(starts) >= 2 and not watch.done()
    batch.set_result(None)
    publisher.health.answered()  # the stall ends: so does the watch
    await asyncio.wait_for(watch, 1.0)


async def test_the_leader_watch_s_client_gives_up_on_a_broker_that_never_answers() -> None:
    # No ten-second diagnostic after a failed start, and no "refused" verdict: None, so the
    # watch tries again from the brokers that answer by then.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        host, port = silent.getsockname()
        publisher = _publisher(f"{host}:{port}")
        assert await publisher.watch.client() is None


async def test_the_wait_for_kafka_ends_when_rows_of_a_partition_taken_back_are_due() -> None:
    # Three brokers, one hung: Kafka moves some partitions before others. Those whose
    # producer was replaced have rows put back for a moment; once they are due a claim
    # may send them, while the other partitions are still stalled.
    publisher = _publisher()
    loop = asyncio.get_running_loop()
    stuck: asyncio.Future[None] = loop.create_future()
    publisher.health.stalled(TP, stuck, leader=1)
    assert publisher.health.next_release() is None  # a stalled partition's hold: not yet
    assert not await publisher.wait_answered(0.05)
    taken_back: asyncio.Future[None] = loop.create_future()
    publisher.health.stalled(OTHER, taken_back, leader=1)  # put back for MIN_DELAY
    publisher.health.forget([taken_back])  # its producer was replaced
    release = publisher.health.next_release()
    assert release is not None and 0 < release <= MIN_DELAY
    # With nothing left to wait for, the backoff is cut short the same way.
    assert publisher.release_within(30.0) <= release and publisher.release_within(0.01) == 0.01
    started = loop.time()
    assert await publisher.wait_answered(30.0)
    assert release - 0.05 <= loop.time() - started < 5.0  # when due, not after the backoff
    assert publisher.health.next_release() is None and publisher.health.waiting == [stuck]


class _SteadyCluster:
    """A metadata client whose answer never changes: the stalled partition's leader live,
    its in-sync replicas the same at every probe (what Kafka shows while a batch waits on
    something the metadata does not show)."""

    def brokers(self) -> list[int]:
        return [1, 2]

    async def ask(self, node: int | None, topics: object) -> ClusterView:
        return ClusterView(frozenset({1, 2}), {TP: PartitionState(leader=1, isr=(1, 2))})

    async def close(self) -> None:
        pass


async def test_a_batch_unanswered_for_three_ack_timeouts_under_a_live_leader_gets_a_new_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = _SteadyCluster()

    async def steady(self: LeaderWatch) -> _SteadyCluster:
        return cluster

    monkeypatch.setattr(LeaderWatch, "client", steady)
    publisher = _publisher()
    serving = object()
    monkeypatch.setattr(publisher.pool, "serving", lambda tp: serving)
    replaced: list[tuple[object, str]] = []
    done = asyncio.Event()

    def replace(producer: object, why: str) -> None:
        replaced.append((producer, why))
        done.set()

    ack_timeout = 0.1
    watch = LeaderWatch(
        AioKafkaClients(OutboxSettings(kafka_bootstrap_servers="a:1")),
        publisher.health,
        publisher.brokers,
        publisher.pool,
        replace,  # type: ignore[arg-type]
        ack_timeout_seconds=ack_timeout,
    )
    batch: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    publisher.health.stalled(TP, batch, leader=1)
    running = asyncio.ensure_future(watch.run())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(done.wait(), 5)
    took = loop.time() - started
    assert replaced and replaced[0][0] is serving, replaced
    assert "orders[3] stalled, unanswered" in replaced[0][1] and "leader 1" in replaced[0][1]
    assert took >= UNANSWERED_ACK_TIMEOUTS * ack_timeout  # not before the bound
    batch.set_result(None)
    publisher.health.answered()
    await asyncio.wait_for(running, 1.0)

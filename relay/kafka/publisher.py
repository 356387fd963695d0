"""Sending events to Kafka and reporting, per event, what Kafka made of them.

The front of the relay's Kafka side (``Publisher``) over four rooms:
:mod:`relay.kafka.planning` packs events into record batches per partition,
:mod:`relay.kafka.producer_pool` owns the producers, :mod:`relay.kafka.brokers` knows which
brokers answer, and :mod:`relay.kafka.leader_watch` follows stalled partitions' leaders. This
module delivers the batches and waits for their answers. The Kafka side knows no source: the
table source and the WAL source hand it events alike.

Kafka is reached through the client interface of outbox/kafka/client.py (aiokafka behind
it): idempotent producers with ``acks="all"``, given whole record batches per (topic,
partition) — one answer per batch instead of one per record, and no per-record trip through
the client's accumulator. A producer that reports :class:`ProducerBroken` (its idempotence
state is gone) is replaced, and its partitions' events are sent again in order.

One sick broker. A batch is sent per partition and waited for per partition: once part of
a publish is acknowledged, a partition still unanswered ``relay.partition_grace_seconds``
later is stalled and its rows go back to the outbox (see :mod:`relay.kafka.partitions`), while
the others' rows are acknowledged and committed. A broken producer is replaced alone; the
partitions of the others never notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from outbox.errors import BrokerUnavailable, ProducerBroken, TopicMissing
from outbox.kafka.aiokafka_client import AioKafkaClients
from outbox.kafka.client import KafkaClients, Producer
from outbox.settings import OutboxSettings, RelaySettings
from relay.event import Event, payload_bytes
from relay.kafka.brokers import BrokerView
from relay.kafka.inflight import ByteBudget
from relay.kafka.leader_watch import LeaderWatch
from relay.kafka.outcome import Outcome, failure_of
from relay.kafka.partitions import PartitionHealth
from relay.kafka.planning import Batches, BatchPlanner
from relay.kafka.producer_pool import ProducerPool, producer_options
from relay.kafka.wording import Wording
from relay.metrics import RelayMetrics

_ACK_SMOOTHING = 0.1

# What a delivery task returns: the producer used and, per batch, None (acked) or the error.
_Delivered = tuple[Producer | None, list[BaseException | None]]


class Publisher:
    """Owns the producers; ``publish(rows)`` returns an :class:`Outcome`, never raises for
    Kafka trouble (that is reported per row)."""

    def __init__(
        self,
        settings: RelaySettings,
        max_payload_bytes: int,
        clients: KafkaClients,
        wording: Wording,
        metrics: RelayMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics or RelayMetrics()
        self.health = PartitionHealth(self._metrics, wording)
        self.brokers = BrokerView(clients.bootstrap, self.health, lambda: self.pool.running())
        options = producer_options(settings, max_payload_bytes)
        self.pool = ProducerPool(settings, options, clients, self.brokers)
        self.planner = BatchPlanner(max_payload_bytes, self.health, self.pool, wording)
        self.watch = LeaderWatch(
            clients,
            self.health,
            self.brokers,
            self.pool,
            self._replace,
            ack_timeout_seconds=settings.ack_timeout_seconds,
        )
        # Deliveries of stalled partitions, and the producer each went through.
        self._stuck: dict[asyncio.Future[Any], Producer | None] = {}
        # Pulsed (set, then cleared) when a producer is replaced: see wait_answered.
        self._replaced = asyncio.Event()
        self.replaced_at = -1e9  # loop time of the last replacement
        self._lock = asyncio.Lock()
        self._inflight = ByteBudget(settings.max_inflight_bytes)
        self.last_ack = -1e9  # loop time of the last acknowledgement, any partition
        self._ack_seconds = 0.05  # smoothed send -> acknowledgement time

    @property
    def failure(self) -> str | None:
        """What ended a background task unexpectedly (the relay's /healthz fails), if any."""
        return self.watch.failure

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.pool.running() is not None

    async def ensure_started(self) -> None:
        """Start a first producer unless some producer runs."""
        async with self._lock:
            if not self.started:
                await self.pool.start(0)

    @classmethod
    def from_settings(
        cls, settings: OutboxSettings, wording: Wording, metrics: RelayMetrics | None = None
    ) -> Publisher:
        """A publisher whose producers are aiokafka's, with the settings' connection."""
        return cls(
            settings.relay, settings.max_payload_bytes, AioKafkaClients(settings), wording, metrics
        )

    def _replace(self, producer: Producer, why: str) -> None:
        """Retire a broken producer; only its partitions notice. Its stalled batches are no
        longer waited for: their rows are back in the outbox and will be sent again."""
        if not self.pool.retire(producer, why):
            return
        retired = [d for d, p in self._stuck.items() if p is producer]
        self.health.forget(retired)
        # Their bytes must not count twice while the old producer flushes.
        self._inflight.let_go(retired)
        self._stuck = {d: p for d, p in self._stuck.items() if p is not producer}
        self.replaced_at = asyncio.get_running_loop().time()
        self._replaced.set()  # wakes every waiter; clearing it does not un-wake them
        self._replaced.clear()

    async def stop(self, within: float) -> None:
        self.planner.forget()
        self._stuck.clear()
        # Whatever the old producers still hold is dropped with them.
        self._inflight = ByteBudget(self._settings.max_inflight_bytes)
        self.watch.stop()
        await self.pool.stop(within)

    @property
    def has_outstanding(self) -> bool:
        return bool(self.health.waiting)

    async def wait_answered(self, within: float) -> bool:
        """The probe for "is Kafka back?" after an outage: True when within ``within`` some
        batch of a stalled partition was answered, or its producer was replaced, or the
        rows put back for a partition no longer stalled became due. A replaced producer's
        batches are no longer waited for (its rows are back in the outbox), and the new one
        starts from brokers that answer: its partitions are worth a try as soon as their
        rows are due. Waiting on the stalled batches instead sat out the backoff — in a
        three-broker hang the partitions Kafka moved first waited for the last ones."""
        waiting = self.health.waiting
        if not waiting:
            return True
        timeout = self.release_within(within)
        replaced = asyncio.ensure_future(self._replaced.wait())
        try:
            done, _ = await asyncio.wait(
                [*waiting, replaced], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            replaced.cancel()
        return bool(done) or timeout < within

    def release_within(self, within: float) -> float:
        """``within``, or sooner when rows put back for a partition that is not stalled (any
        more) are due sooner: a claim may send them then."""
        release = self.health.next_release()
        return within if release is None else min(within, release)

    def _collect(self) -> None:
        """End the stalls whose batches Kafka has answered; replace a producer whose late
        answer says it is broken."""
        broken: list[Producer] = []
        for delivery in self.health.answered():
            producer = self._stuck.pop(delivery, None)
            if delivery.cancelled() or producer is None:
                continue
            _, results = delivery.result()
            if any(isinstance(r, ProducerBroken) for r in results):
                broken.append(producer)
            elif any(r is None for r in results):
                self.last_ack = asyncio.get_running_loop().time()
        for producer in broken:
            self._replace(producer, "a late answer says it is broken")

    async def has_topic(self, topic: str) -> bool:
        """Whether Kafka knows ``topic`` (asks the broker; the producer must be started)."""
        producer = self.pool.running()
        assert producer is not None
        try:
            await self.planner.partitions_for(producer, topic)
        except TopicMissing:
            return False
        return True

    def topic_missing(self, topic: str, delay: float) -> None:
        """``topic``'s rows went back for ``delay`` seconds because it does not exist: ask
        Kafka for it again next time, and hold its later rows until those are due (see
        relay.kafka.partitions)."""
        self.planner.topic_missing(topic)
        self.health.topic_missing(topic, delay)

    # -- publishing -------------------------------------------------------------------------------
    async def publish(self, rows: Sequence[Event], claimed_at: float | None = None) -> Outcome:
        """Send ``rows`` (per lane in id order) and wait for their acks. ``claimed_at``: the
        loop time before the claim began (rows of partitions held back since then wait)."""
        outcome = Outcome()
        loop = asyncio.get_running_loop()
        claimed_at = loop.time() if claimed_at is None else claimed_at
        self._collect()
        timeout = self._settings.ack_timeout_seconds
        budget = self._inflight
        sizes = [payload_bytes(row) for row in rows]
        taken = await budget.acquire(sum(sizes), timeout)
        if taken is None:
            busy = BrokerUnavailable(
                "Kafka has not answered for earlier batches (relay.max_inflight_bytes in flight)"
            )
            outcome.failed = dict.fromkeys(range(len(rows)), busy)
            return outcome
        try:
            plan = await asyncio.wait_for(self.planner.plan(rows, outcome, claimed_at), timeout)
        except Exception as exc:  # no producer, or metadata trouble: nothing was sent
            budget.release(taken)
            failure = failure_of(exc)
            for i in range(len(rows)):
                outcome.failed.setdefault(i, failure)
            return outcome
        # The producer each partition's batches were queued on, once its start is done.
        via: dict[tuple[str, int], Producer] = {}
        deliveries = {
            tp: asyncio.ensure_future(self._deliver(tp, b, via)) for tp, b in plan.items()
        }
        # Each partition's bytes stay taken while Kafka holds its batches, a stalled one's
        # included; what the plan left out (rows refused or held back) comes back now, so a
        # sick partition holds only its own share and never the healthy ones'.
        left = taken
        for tp, delivery in deliveries.items():
            share = min(left, sum(sizes[i] for _, idx in plan[tp] for i in idx))
            budget.hold(delivery, share)
            left -= share
        budget.release(left)
        await self._wait(deliveries.values())
        for tp, delivery in deliveries.items():
            if not delivery.done():
                # The producer this delivery was queued on (none yet: it still waits for
                # the start of tp's producer, and will go through it), if it still serves
                # tp. Not pool.serving(tp) alone: when the leader watch (or another
                # pipeline's ProducerBroken) replaced the producer during the wait and a
                # successor was started meanwhile, the batch waits on the retired
                # producer, whose close fails it (ProducerClosed) only after its flush;
                # charged to the successor, it stalled the partition for that flush, and
                # its late "broken" answer then retired the healthy successor too.
                serving = self.pool.serving(tp)
                producer = serving if via.get(tp, serving) is serving else None
                unavailable = self.health.stalled(tp, delivery, self.pool.leader(tp))
                if producer is None:  # replaced meanwhile: no answer will come
                    self.health.forget([delivery])
                    budget.let_go([delivery])
                else:
                    self._stuck[delivery] = producer
                for _, idx in plan[tp]:
                    outcome.failed.update(dict.fromkeys(idx, unavailable))
                continue
            producer, results = _result(delivery, len(plan[tp]))
            for (_, idx), error in zip(plan[tp], results, strict=True):
                if error is None:
                    outcome.acked.extend(idx)
                    if (leader := self.pool.leader(tp)) is not None:
                        self.brokers.heard_from(leader)
                    continue
                failure = failure_of(error)
                outcome.failed.update(dict.fromkeys(idx, failure))
                if isinstance(failure, ProducerBroken) and producer is not None:
                    self._replace(producer, f"{tp[0]}[{tp[1]}]: {type(error).__name__}")
        if outcome.acked:
            self.last_ack = loop.time()
        self.health.report(self.planner.partitions)
        if self.health.unavailable:
            self.watch.ensure()
        return outcome

    async def _wait(self, deliveries: Iterable[asyncio.Future[_Delivered]]) -> None:
        """Until every delivery is answered, or a partition's answer is overdue: once Kafka
        acknowledges anything (in this publish, or in any within the ack timeout), the
        others get a grace — ``relay.partition_grace_seconds``, or three times the usual
        acknowledgement time when that is longer (on a loaded host acknowledgements drift
        apart, and calling a merely slow partition unavailable costs duplicates). While
        Kafka acknowledges nothing at all, the wait lasts up to the ack timeout."""
        r = self._settings
        loop = asyncio.get_running_loop()
        start = loop.time()
        grace = max(r.partition_grace_seconds, 3 * self._ack_seconds)
        responsive = start - self.last_ack < r.ack_timeout_seconds
        deadline = start + (grace if responsive else r.ack_timeout_seconds)
        pending = set(deliveries)
        while pending:
            left = deadline - loop.time()
            if left <= 0:
                return
            done, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            acked = [d for d in done if _acked(d)]
            if acked:
                now = loop.time()
                for _ in acked:
                    self._ack_seconds += (now - start - self._ack_seconds) * _ACK_SMOOTHING
                deadline = min(deadline, now + grace)

    async def _deliver(
        self, tp: tuple[str, int], batches: Batches, via: dict[tuple[str, int], Producer]
    ) -> _Delivered:
        """Queue ``tp``'s batches in order on its producer (noted in ``via``) and wait for
        each answer."""
        try:
            producer = await self.pool.start(self.pool.index_of(tp))
        except Exception as exc:
            return None, [exc] * len(batches)
        via[tp] = producer
        return producer, list(await producer.deliver(tp, [batch for batch, _ in batches]))


def _acked(delivery: asyncio.Future[_Delivered]) -> bool:
    if delivery.cancelled() or delivery.exception() is not None:
        return False
    return any(r is None for r in delivery.result()[1])


def _result(delivery: asyncio.Future[_Delivered], batches: int) -> _Delivered:
    """A finished delivery's answer; a delivery that died says why for every batch."""
    if delivery.cancelled():
        return None, [asyncio.CancelledError()] * batches
    error = delivery.exception()
    if error is not None:
        return None, [error] * batches
    return delivery.result()

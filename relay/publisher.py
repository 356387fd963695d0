"""Sending claimed rows to Kafka and reporting, per row, what Kafka made of them.

Idempotent ``AIOKafkaProducer``s with ``acks="all"``. Rows are packed into record batches
per (topic, partition) with ``create_batch``/``send_batch``: one future per batch instead of
one per record, and no per-record trip through the accumulator (several times faster than
``send()`` per record).

Why per-key order survives retries: aiokafka keeps at most one produce request in flight
per broker and mutes a partition while its batch is in flight, and with idempotence a
retriable failure is retried in place (batches never expire), so a retry can never
overtake a later batch of the same partition. A batch the broker rejects for good leaves
a sequence gap, so the later batches of that partition fail too (OutOfOrderSequence);
those are reported as :class:`ProducerBroken` and that producer is replaced, which again
re-sends them in order.

One sick broker. Kafka answers a produce request once every partition in it is
acknowledged, and one connection serves one request at a time; a single producer would tie
every partition a broker leads to the slowest of them (with ``acks=all``, to any partition
waiting for a dead in-sync replica). So partitions are spread over up to
``relay.producers`` producers (each its own connections), a batch is sent per partition and
waited for per partition: once part of a publish is acknowledged, a partition still
unanswered ``relay.partition_grace_seconds`` later is stalled and its rows go back to the
outbox (see :mod:`relay.partitions`), while the others' rows are acknowledged and
committed. A broken producer is replaced alone; the partitions of the others never notice.

Partitions are chosen like Kafka's default partitioner (murmur2 of the key), so keyed
records land where any Kafka client would put them; keyless records stick to one random
partition per batch (they carry no order promise).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka import errors as kerr
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import murmur2

from outbox import kafka_room
from outbox.daemon import kafka_admin, kafka_producer, kafka_refusal, start_kafka, supervise
from outbox.errors import BrokerUnavailable, ConfigurationError, TopicMissing
from outbox.settings import OutboxSettings
from relay.errors import PartitionUnavailable, ProducerBroken, RecordRejected, RecordTooLarge
from relay.inflight import ByteBudget
from relay.metrics import RelayMetrics
from relay.partitions import PartitionHealth
from relay.store import (
    CE_ID,
    CE_TIME,
    CONTENT_TYPE,
    EVENT_TYPE,
    HEADERS,
    KEY,
    PAYLOAD,
    SOURCE,
    TOPIC,
    ClaimedRow,
    payload_bytes,
)

log = logging.getLogger("relay.publisher")

# Broker answers that concern the record itself: retrying the same bytes cannot succeed.
_REJECTIONS = (
    kerr.MessageSizeTooLargeError,
    kerr.RecordListTooLargeError,
    kerr.InvalidTopicError,
    kerr.TopicAuthorizationFailedError,
    kerr.CorruptRecordException,
    kerr.InvalidTimestampError,
    kerr.PolicyViolationError,
    kerr.UnsupportedForMessageFormatError,
)
# Answers after which this producer instance is unusable (idempotence state lost/fenced).
_BROKEN = (
    kerr.OutOfOrderSequenceNumber,
    kerr.UnknownProducerId,
    kerr.InvalidProducerEpoch,
    kerr.ProducerFenced,
    kerr.ProducerClosed,
)
_SPEC = b"1.0"
# While partitions are stalled, how often their leaders are looked up, and how long one
# broker may take to answer (see Publisher._watch_leaders). Every probe interval adds to how
# long a partition stays held after Kafka's failover; one small metadata request to a broker
# that answers, only while something is stalled, costs little.
LEADER_PROBE_SECONDS = 0.25
# After Kafka took a hung broker out of a partition's in-sync replicas, how long the batch
# waiting there gets to be answered before its producer is replaced. It is usually answered
# at once, or after one retry when its request timed out first (three brokers: every
# partition waits for the failover, longer than a request timeout). Replacing it sooner
# re-sends its rows while it lands too: with 0.25 s a 3-broker hang left 500-950 copies,
# and the consumer, reading through them, fell 7-8 s behind.
ISR_SETTLE_SECONDS = 1.0
_ACK_SMOOTHING = 0.1
LEADER_PROBE_TIMEOUT_MS = 1500
# A start of the leader watch's client tries the brokers it is given one after the other,
# one probe timeout each; past this it is tried again from a fresh list.
WATCH_START_SECONDS = 5.0
# A broker that acknowledged within this long is known to answer (a hung one stops at once).
ANSWERED_SECONDS = 3.0
_KEY_CACHE_LIMIT = 100_000


def classify(exc: BaseException) -> Exception:
    """Map an aiokafka failure to the framework's tree: row-level rejection or transient."""
    if isinstance(exc, asyncio.CancelledError):
        return BrokerUnavailable("send cancelled")
    if isinstance(
        exc, RecordRejected | TopicMissing | ProducerBroken | BrokerUnavailable | ConfigurationError
    ):
        return exc
    refused = kafka_refusal(exc)
    if refused is not None:
        return refused
    name = type(exc).__name__
    if isinstance(exc, _REJECTIONS):
        return RecordRejected(f"Kafka rejected the record: {name}")
    if isinstance(exc, _BROKEN):
        return ProducerBroken(f"Kafka producer must be recreated: {name}")
    return BrokerUnavailable(f"Kafka unavailable: {name}")


@dataclass
class Outcome:
    """What happened to each row of one publish call (indexes into the rows given)."""

    acked: list[int] = field(default_factory=list)
    # index -> error; RecordRejected counts an attempt, TopicMissing and PartitionUnavailable
    # delay the row without one, anything else (Kafka down) neither.
    failed: dict[int, Exception] = field(default_factory=dict)

    @property
    def transient(self) -> Exception | None:
        """The first failure that concerns Kafka as a whole (unreachable, producer broken);
        rejected rows, missing topics and unavailable partitions concern only themselves."""
        for exc in self.failed.values():
            if not isinstance(exc, RecordRejected | TopicMissing | PartitionUnavailable):
                return exc
        return None


# One partition's share of a publish: its record batches and the row indexes in each.
_Batches = list[tuple[Any, list[int]]]
# What a delivery task returns: the producer used and, per batch, None (acked) or the error.
_Delivered = tuple[AIOKafkaProducer | None, list[BaseException | None]]


class Publisher:
    """Owns the producers; ``publish(rows)`` returns an :class:`Outcome`, never raises for
    Kafka trouble (that is reported per row)."""

    def __init__(self, settings: OutboxSettings, metrics: RelayMetrics | None = None) -> None:
        self._settings = settings
        self._metrics = metrics or RelayMetrics()
        # Producer i serves the partitions mapped to it (any one answers metadata questions
        # and builds batches); started on first use.
        self._producers: list[AIOKafkaProducer | None] = [None] * settings.relay.producers
        self._starting: dict[int, asyncio.Task[AIOKafkaProducer]] = {}
        self._producer_of: dict[tuple[str, int], int] = {}
        self._partitions: dict[str, list[int]] = {}
        self._key_partition: dict[str, dict[bytes, int]] = {}
        self.health = PartitionHealth(self._metrics)
        # Deliveries of stalled partitions, and the producer each went through.
        self._stuck: dict[asyncio.Future[Any], AIOKafkaProducer | None] = {}
        self._closing: set[asyncio.Task[None]] = set()  # replaced producers, flushing
        # Pulsed (set, then cleared) when a producer is replaced: see wait_answered.
        self._replaced = asyncio.Event()
        self.replaced_at = -1e9  # loop time of the last replacement
        self._watcher: asyncio.Task[None] | None = None  # leaders of stalled partitions
        # What ended a background task unexpectedly (the relay's /healthz fails), if any.
        self.failure: str | None = None
        self._live: set[int] = set()  # brokers Kafka listed last (not fenced)
        self._answered: dict[int, float] = {}  # broker -> loop time it last answered
        self._lock = asyncio.Lock()
        self._missing: set[str] = set()  # topics known to be missing (logged once each)
        self._inflight = ByteBudget(settings.relay.max_inflight_bytes)
        self.last_ack = -1e9  # loop time of the last acknowledgement, any partition
        self._ack_seconds = 0.05  # smoothed send -> acknowledgement time

    # -- lifecycle ----------------------------------------------------------------------------
    def _bootstrap(self) -> str:
        """Where a new client should connect first: the brokers a running producer knows
        to answer now (acknowledged lately, not leading a stalled partition), if any; else
        every broker it knows and the configured list. aiokafka tries the list in a random
        order, and a hung broker in it holds one start in four for a whole request timeout
        (measured: the hung-broker test's partitions waited for the broker's return)."""
        configured = [a.strip() for a in self._settings.kafka_bootstrap_servers.split(",")]
        running = self._running()
        if running is None:
            return ",".join(configured)
        brokers = running.client.cluster.brokers()
        best, answering = self._preferred([b.nodeId for b in brokers])
        if best and (len(best) < len(brokers) or answering):
            # Not the configured list as well: it names the sick broker (a fenced one is
            # no longer among those Kafka lists), and a new producer that tried it first
            # waited for the hung broker's return.
            return ",".join(f"{b.host}:{b.port}" for b in brokers if b.nodeId in best)
        return ",".join(dict.fromkeys([f"{b.host}:{b.port}" for b in brokers] + configured))

    def _preferred(self, nodes: list[int]) -> tuple[list[int], bool]:
        """The brokers of ``nodes`` to ask first, and whether they are known to answer:
        those that answer now and lead no stalled partition; else those that answer (with
        ``acks=all`` a healthy leader's partitions stall too while they wait for a hung
        follower, and it still answers everything else: a hung broker answers nothing);
        else those not known to be sick. Empty when every one is sick."""
        sick, answering = self._sick(), self._answering()
        for choice in (
            [n for n in nodes if n in answering and n not in sick],
            [n for n in nodes if n in answering],
        ):
            if choice:
                return choice, True
        return [n for n in nodes if n not in sick], False

    def _running(self) -> AIOKafkaProducer | None:
        return next((p for p in self._producers if p is not None), None)

    def _answering(self) -> set[int]:
        """Brokers that acknowledged a batch, or answered the leader watch, within the last
        ``ANSWERED_SECONDS``: known to answer now. After a failover the hung broker's
        stalls are forgotten (its partitions have new leaders), so "sick" no longer names
        it; "answering" still leaves it out."""
        now = asyncio.get_running_loop().time()
        return {b for b, at in self._answered.items() if now - at < ANSWERED_SECONDS}

    def _sick(self) -> set[int]:
        """Brokers to keep away from: leaders of stalled partitions, and brokers missing
        from the live ones the leader watch saw last (Kafka fenced them)."""
        sick = {leader for leader in self.health.leaders().values() if leader is not None}
        running = self._running()
        if running is not None and self._live:
            sick |= {b.nodeId for b in running.client.cluster.brokers()} - self._live
        return sick

    def _watch_died(self) -> None:
        self.failure = "leader watch died"

    def _pick_node(self, client: Any) -> int | None:
        """aiokafka asks a broker chosen at random for a new producer's id: one that hangs
        holds the start for a whole request timeout. Prefer the others."""
        nodes: list[int] = [b.nodeId for b in client.cluster.brokers()]
        if not nodes:
            return None
        return random.choice(self._preferred(nodes)[0] or nodes)

    def _new_producer(self, bootstrap: str) -> AIOKafkaProducer:
        r = self._settings.relay
        producer = kafka_producer(
            self._settings,
            bootstrap_servers=bootstrap,
            client_id="outbox-relay",
            acks="all",
            enable_idempotence=True,
            linger_ms=r.linger_ms,
            max_batch_size=r.max_batch_bytes,
            # Larger than any single batch we build, so one request can carry a batch for
            # every partition of the claim.
            max_request_size=max(r.max_batch_bytes, self._settings.max_payload_bytes) * 4,
            request_timeout_ms=int(r.ack_timeout_seconds * 1000),
            retry_backoff_ms=200,
        )
        kafka_room.prefer_brokers(producer, self._pick_node)
        return producer

    async def _start(self, index: int) -> AIOKafkaProducer:
        """Producer ``index``, started if it is not (one start at a time per index);
        raises the classified error when Kafka cannot be reached."""
        producer = self._producers[index]
        if producer is not None:
            return producer
        task = self._starting.get(index)
        if task is None:
            task = self._starting[index] = asyncio.ensure_future(self._connect(index))
            task.add_done_callback(lambda _: self._starting.pop(index, None))
        return await asyncio.shield(task)

    async def _connect(self, index: int) -> AIOKafkaProducer:
        bootstrap = self._bootstrap()
        producer = self._new_producer(bootstrap)
        started = asyncio.get_running_loop().time()
        try:
            await start_kafka(producer, self._settings)
        except BaseException as exc:  # stop() cancels a start: it must not leak either
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 2.0)
            if isinstance(exc, Exception):
                raise classify(exc) from exc
            raise
        # Registered here, before anyone waiting for this start resumes: once the start is
        # done a caller arriving before them would find neither a producer nor a start and
        # start a second one, used for its batches but never kept — so never closed, and
        # never replaced when a partition it sent to stalls (the stall then lasted until its
        # batch timed out).
        self._producers[index] = producer
        log.debug(
            "producer %d started in %.2f s (bootstrap %s)",
            index,
            asyncio.get_running_loop().time() - started,
            bootstrap,
        )
        return producer

    @property
    def started(self) -> bool:
        return self._running() is not None

    async def ensure_started(self) -> None:
        """Start a first producer unless some producer runs."""
        async with self._lock:
            if not self.started:
                await self._start(0)

    def _replace(self, producer: AIOKafkaProducer, why: str) -> None:
        """Retire a broken producer (a new producer id restarts the sequence numbers); the
        next batch of its partitions starts a new one. Only its partitions notice."""
        if producer not in self._producers:
            return  # replaced already (several of its partitions said so)
        log.debug("producer replaced: %s", why)
        for i, current in enumerate(self._producers):
            if current is producer:
                self._producers[i] = None
        retired = [d for d, p in self._stuck.items() if p is producer]
        self.health.forget(retired)
        # Their rows are back in the outbox and will be sent again: their bytes must not
        # count twice while the old producer flushes.
        self._inflight.let_go(retired)
        self._stuck = {d: p for d, p in self._stuck.items() if p is not producer}
        # Its queued batches may still be acknowledged (copies of rows that are back in the
        # outbox: duplicates, never reordered); let it flush in the background.
        flush = self._settings.relay.ack_timeout_seconds
        task = asyncio.ensure_future(self._close(producer, flush))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self.replaced_at = asyncio.get_running_loop().time()
        self._replaced.set()  # wakes every waiter; clearing it does not un-wake them
        self._replaced.clear()

    async def stop(self, within: float) -> None:
        producers = [p for p in self._producers if p is not None]
        self._producers = [None] * len(self._producers)
        self._partitions.clear()
        self._stuck.clear()
        # Whatever the old producers still hold is dropped with them.
        self._inflight = ByteBudget(self._settings.relay.max_inflight_bytes)
        for task in [*self._closing, *self._starting.values()]:
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        await asyncio.gather(*(self._close(p, within) for p in producers))

    async def _close(self, producer: AIOKafkaProducer, within: float = 2.0) -> None:
        # stop() flushes, and a batch waiting on a dead or hung broker never finishes. Rows
        # not acked are still in the database, so failing what is still queued loses
        # nothing; then the producer closes its sender and connections instead of retrying
        # forever. (aiokafka has no public "close without flushing".)
        stopping = asyncio.ensure_future(producer.stop())
        try:
            await asyncio.wait({stopping}, timeout=within)
            if not stopping.done():
                kafka_room.abandon_queued(producer, kerr.ProducerClosed())
                # The sender waits for its requests in flight (at most the request timeout).
                await asyncio.wait({stopping}, timeout=self._settings.relay.ack_timeout_seconds)
            if stopping.done() and not stopping.cancelled() and stopping.exception():
                log.debug("producer stop failed: %r", stopping.exception())
        finally:
            if not stopping.done():
                stopping.cancel()

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
        broken: list[AIOKafkaProducer] = []
        for delivery in self.health.answered():
            producer = self._stuck.pop(delivery, None)
            if delivery.cancelled() or producer is None:
                continue
            _, results = delivery.result()
            if any(isinstance(classify(r), ProducerBroken) for r in results if r is not None):
                broken.append(producer)
            elif any(r is None for r in results):
                self.last_ack = asyncio.get_running_loop().time()
        for producer in broken:
            self._replace(producer, "a late answer says it is broken")

    # -- metadata -------------------------------------------------------------------------------
    async def _partitions_for(self, producer: AIOKafkaProducer, topic: str) -> list[int]:
        """Partitions of ``topic``; TopicMissing when metadata says it does not exist."""
        parts = self._partitions.get(topic)
        if parts is not None:
            return parts
        client = producer.client
        known = client.cluster.partitions_for_topic(topic)
        if known is None:
            # Ask the broker (aiokafka's own wait would poll for request_timeout_ms).
            client.add_topic(topic)
            if not await asyncio.wait_for(client.force_metadata_update(), 10.0):
                raise BrokerUnavailable("Kafka unavailable: metadata request failed")
            if topic in client.cluster.unauthorized_topics:
                raise RecordRejected(f"not authorized to write to Kafka topic {topic!r}")
            known = client.cluster.partitions_for_topic(topic)
            if known is None:
                if topic not in self._missing:
                    self._missing.add(topic)
                    log.warning(
                        "Kafka topic missing; its rows wait in the outbox (no attempts counted) "
                        "until it exists: outbox topics ensure --topic %s",
                        topic,
                        extra={"topic": topic},
                    )
                raise TopicMissing(topic)
        if topic in self._missing:
            self._missing.discard(topic)
            log.info("Kafka topic exists now; publishing its rows", extra={"topic": topic})
        parts = sorted(known)
        self._partitions[topic] = parts
        return parts

    async def has_topic(self, topic: str) -> bool:
        """Whether Kafka knows ``topic`` (asks the broker; the producer must be started)."""
        producer = self._running()
        assert producer is not None
        try:
            await self._partitions_for(producer, topic)
        except TopicMissing:
            return False
        return True

    def _partition(self, topic: str, parts: list[int], key: bytes) -> int:
        cache = self._key_partition.setdefault(topic, {})
        p = cache.get(key)
        if p is None:
            if len(cache) > _KEY_CACHE_LIMIT:
                cache.clear()
            p = cache[key] = parts[(murmur2(key) & 0x7FFFFFFF) % len(parts)]
        return p

    def topic_missing(self, topic: str, delay: float) -> None:
        """``topic``'s rows went back for ``delay`` seconds because it does not exist: ask
        Kafka for it again next time, and hold its later rows until those are due (see
        relay.partitions)."""
        self._partitions.pop(topic, None)
        self._key_partition.pop(topic, None)
        self.health.topic_missing(topic, delay)

    def _leader(self, tp: tuple[str, int]) -> int | None:
        producer = self._producers[self._producer_of.get(tp, 0)] or self._running()
        if producer is None:
            return None
        leader = producer.client.cluster.leader_for_partition(TopicPartition(*tp))
        return None if leader is None else int(leader)

    # -- publishing -------------------------------------------------------------------------------
    async def publish(self, rows: Sequence[ClaimedRow], claimed_at: float | None = None) -> Outcome:
        """Send ``rows`` (per lane in id order) and wait for their acks. ``claimed_at``: the
        loop time before the claim began (rows of partitions held back since then wait)."""
        outcome = Outcome()
        loop = asyncio.get_running_loop()
        claimed_at = loop.time() if claimed_at is None else claimed_at
        self._collect()
        timeout = self._settings.relay.ack_timeout_seconds
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
            plan = await asyncio.wait_for(self._plan(rows, outcome, claimed_at), timeout)
        except Exception as exc:  # no producer, or metadata trouble: nothing was sent
            budget.release(taken)
            failure = classify(exc)
            for i in range(len(rows)):
                outcome.failed.setdefault(i, failure)
            return outcome
        deliveries = {tp: asyncio.ensure_future(self._deliver(tp, b)) for tp, b in plan.items()}
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
                producer = self._producers[self._producer_of[tp]]
                unavailable = self.health.stalled(tp, delivery, self._leader(tp))
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
                    if (leader := self._leader(tp)) is not None:
                        self._answered[leader] = loop.time()
                    continue
                failure = classify(error)
                outcome.failed.update(dict.fromkeys(idx, failure))
                if isinstance(failure, ProducerBroken) and producer is not None:
                    self._replace(producer, f"{tp[0]}[{tp[1]}]: {type(error).__name__}")
        if outcome.acked:
            self.last_ack = loop.time()
        self.health.report(self._partitions)
        if self.health.unavailable:
            self._ensure_watch()
        return outcome

    def _ensure_watch(self) -> None:
        """Start the leader watch unless it runs — or died (a bug: logged at ERROR, and
        /healthz fails until the relay is restarted), or this aiokafka cannot send its
        metadata requests (said at start: stalls then wait for aiokafka's own retries)."""
        running = self._watcher is not None and not self._watcher.done()
        if running or self.failure is not None or not kafka_room.usable(kafka_room.METADATA):
            return
        self._watcher = asyncio.ensure_future(self._watch_leaders())
        supervise(self._watcher, "relay leader watch", log, self._watch_died)

    async def _watch_leaders(self) -> None:
        """While partitions are stalled, ask Kafka how they stand (a client of its own,
        short timeouts: the broker it happens to ask may be the hung one). aiokafka keeps a
        batch sent to a broker that hangs in flight there for a whole request timeout, and
        its retry may wait as long again for a metadata refresh stuck on that broker —
        even after Kafka moved the partition's leadership, or took the hung broker out of
        its in-sync replicas. So once Kafka has acted on a stalled partition (its leader or
        in-sync replicas changed) and the batch still waits, the partition's producer is
        replaced: a new one, bootstrapped from brokers that answer, sends its rows at once.
        (The old batch cannot be committed by a broker that no longer leads, and a copy
        that lands later is a duplicate, never reordered: see relay.partitions.)"""
        loop = asyncio.get_running_loop()
        admin: AIOKafkaAdminClient | None = None
        seen: dict[tuple[str, int], tuple[int, ...]] = {}  # in-sync replicas first seen
        acted: dict[tuple[str, int], float] = {}  # when Kafka was first seen to have acted
        try:
            while self.health.unavailable:
                await asyncio.sleep(LEADER_PROBE_SECONDS)
                if admin is None and (admin := await self._watch_client()) is None:
                    continue
                stalled = self.health.leaders()
                # One metadata request: the topics, and the brokers Kafka lists (not
                # fenced). describe_topics would drop the brokers, describe_cluster would
                # ask for every topic of the cluster. Whether the broker asked answers is
                # news too: when every partition waits for a hung replica (three brokers,
                # replication factor 3) no broker acknowledges anything, and this is how
                # the brokers that still answer are told from the hung one.
                node = self._pick_node(kafka_room.client_of(admin))
                try:
                    answer = await asyncio.wait_for(
                        kafka_room.ask_metadata(admin, node, sorted({t for t, _ in stalled})),
                        LEADER_PROBE_TIMEOUT_MS / 1000 * 2,
                    )
                except kafka_room.MetadataUnavailable:
                    return  # said once at WARNING; stalls wait for aiokafka's own retries
                except Exception as exc:  # asked the sick broker, probably: ask another
                    log.debug("leader watch: broker %s did not answer: %r", node, exc)
                    if node is not None:
                        self._answered.pop(node, None)
                    continue
                if node is not None:
                    self._answered[node] = loop.time()
                metadata = answer.to_object()
                described = metadata["topics"]
                self._live = {int(b["node_id"]) for b in metadata["brokers"]}
                now = loop.time()
                for topic in described:
                    for p in topic["partitions"]:
                        tp = (topic["topic"], p["partition"])
                        if tp not in stalled or p["leader"] < 0:
                            continue
                        isr = tuple(sorted(p["isr"]))
                        moved = p["leader"] != stalled[tp]
                        if not moved and seen.setdefault(tp, isr) == isr:
                            continue
                        # A new leader: the batch waits on the old one. In-sync replicas
                        # changed: the batch should be answered now; give it a moment.
                        if moved or now - acted.setdefault(tp, now) >= ISR_SETTLE_SECONDS:
                            producer = self._producers[self._producer_of.get(tp, 0)]
                            if producer is not None:
                                change = f"leader {p['leader']}" if moved else f"in-sync {isr}"
                                self._replace(producer, f"{tp[0]}[{tp[1]}] stalled, {change}")
                seen = {tp: v for tp, v in seen.items() if tp in stalled}
                acted = {tp: v for tp, v in acted.items() if tp in self.health.leaders()}
        finally:  # an unexpected error ends the watch loudly (see publish: supervise)
            if admin is not None:
                await _close_quietly(admin)

    async def _watch_client(self) -> AIOKafkaAdminClient | None:
        """The leader watch's client, started; None when it could not start in time (the
        watch tries again at its next probe, from the brokers that answer by then). A hang
        has just begun when the watch starts, so the broker that hangs may still count as
        answering, and a start that asks it fails after one short request timeout. Not
        ``start_kafka``: after a failed start it asks the first configured broker — maybe
        the hung one — for up to 10 s whether the client was refused, and a refusal is the
        producers' to report. (In hang test runs the watch sat in it for 10 s, through
        Kafka's failover: the hung broker's partitions waited for their request timeout.)"""
        admin = kafka_admin(
            self._settings,
            bootstrap_servers=self._bootstrap(),
            request_timeout_ms=LEADER_PROBE_TIMEOUT_MS,
        )
        # Its metadata requests go to a broker chosen at random, as a producer's id does:
        # the same preference for brokers that answer.
        kafka_room.prefer_brokers(admin, self._pick_node)
        try:
            await asyncio.wait_for(admin.start(), WATCH_START_SECONDS)
        except Exception as exc:
            log.debug("leader watch: its client did not start: %r", exc)
            await _close_quietly(admin)
            return None
        return admin

    async def _wait(self, deliveries: Iterable[asyncio.Future[_Delivered]]) -> None:
        """Until every delivery is answered, or a partition's answer is overdue: once Kafka
        acknowledges anything (in this publish, or in any within the ack timeout), the
        others get a grace — ``relay.partition_grace_seconds``, or three times the usual
        acknowledgement time when that is longer (on a loaded host acknowledgements drift
        apart, and calling a merely slow partition unavailable costs duplicates). While
        Kafka acknowledges nothing at all, the wait lasts up to the ack timeout."""
        r = self._settings.relay
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

    async def _deliver(self, tp: tuple[str, int], batches: _Batches) -> _Delivered:
        """Queue ``tp``'s batches in order on its producer and wait for each answer."""
        try:
            producer = await self._start(self._producer_of[tp])
        except Exception as exc:
            return None, [exc] * len(batches)
        futures: list[asyncio.Future[Any]] = []
        refused: BaseException | None = None
        for builder, _ in batches:
            try:
                future = await producer.send_batch(builder, tp[0], partition=tp[1])
            except Exception as exc:
                # Not queued: no later batch of this partition may overtake it.
                refused = exc
                break
            # Its answer is read below, unless this delivery is cancelled first (the relay
            # stopping, the loop closing) and the batch fails later — a retired producer's
            # batches fail with ProducerClosed when it is closed: read it anyway, or asyncio
            # prints "Future exception was never retrieved" for each at exit. (The batch's
            # own future, behind this shield, is read by kafka_room.abandon_queued.)
            future.add_done_callback(_observed)
            futures.append(future)
        results: list[BaseException | None] = []
        for future in futures:
            try:
                await future
                results.append(None)
            except Exception as exc:
                results.append(exc)
        results.extend([refused] * (len(batches) - len(results)))
        return producer, results

    async def _plan(
        self, rows: Sequence[ClaimedRow], outcome: Outcome, claimed_at: float
    ) -> dict[tuple[str, int], _Batches]:
        """Pack the rows into record batches per partition (in row order); rows that cannot
        go now (too large, topic missing, partition held back) are reported in ``outcome``."""
        # Any running producer answers metadata and builds batches (the same for all).
        producer = self._running() or await self._start(0)
        limit = self._settings.max_payload_bytes
        plan: dict[tuple[str, int], _Batches] = {}
        refused: dict[tuple[str, int], PartitionUnavailable | None] = {}
        parts_of: dict[str, list[int] | Exception] = {}
        sticky: dict[str, int] = {}
        producers = len(self._producers)
        for i, row in enumerate(rows):
            topic = row[TOPIC]
            parts = parts_of.get(topic)
            if parts is None:
                try:
                    parts = await self._partitions_for(producer, topic)
                except (RecordRejected, TopicMissing) as exc:
                    parts = exc
                parts_of[topic] = parts
            if isinstance(parts, Exception):
                outcome.failed[i] = parts
                continue
            key: bytes | None = row[KEY]
            if key is None:
                partition = sticky.setdefault(topic, random.choice(parts))
            else:
                partition = self._partition(topic, parts, key)
            tp = (topic, partition)
            if tp not in refused:
                refused[tp] = self.health.refusal(tp, claimed_at)
            unavailable = refused[tp]
            if unavailable is not None:
                outcome.failed[i] = unavailable
                continue
            payload: bytes | None = row[PAYLOAD]  # None: a tombstone
            headers = [
                ("ce_id", row[CE_ID].encode()),
                ("ce_type", row[EVENT_TYPE].encode()),
                ("ce_source", row[SOURCE].encode()),
                ("ce_time", row[CE_TIME].encode()),
                ("ce_specversion", _SPEC),
            ]
            if row[CONTENT_TYPE] is not None:  # a tombstone has no content to describe
                headers.append(("content-type", row[CONTENT_TYPE].encode()))
            own = len(headers)
            if row[HEADERS] != "{}":
                headers.extend((k, v.encode()) for k, v in json.loads(row[HEADERS]).items())
            size = len(payload or b"") + len(key or b"") + sum(len(v) for _, v in headers[own:])
            if size > limit:
                outcome.failed[i] = RecordTooLarge(size, limit)
                continue
            batches = plan.get(tp)
            if batches is None:
                if tp not in self._producer_of:
                    self._producer_of[tp] = len(self._producer_of) % producers
                batches = plan[tp] = [(producer.create_batch(), [])]
            builder, idx = batches[-1]
            if builder.append(key=key, value=payload, timestamp=None, headers=headers) is None:
                builder, idx = producer.create_batch(), []
                batches.append((builder, idx))
                # A fresh batch always takes its first record, however large.
                builder.append(key=key, value=payload, timestamp=None, headers=headers)
            idx.append(i)
        return plan


async def _close_quietly(admin: AIOKafkaAdminClient) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(admin.close(), 2.0)


def _observed(future: asyncio.Future[Any]) -> None:
    """Mark a batch's failure as seen (whoever waits for it reads it as well)."""
    if not future.cancelled():
        future.exception()


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

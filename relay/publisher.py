"""Sending claimed rows to Kafka and reporting, per row, what Kafka made of them.

One long-lived ``AIOKafkaProducer`` with ``acks="all"`` and idempotence. Rows are packed
into record batches per (topic, partition) with ``create_batch``/``send_batch``: one
future per batch instead of one per record, and no per-record trip through the
accumulator (several times faster than ``send()`` per record).

Why per-key order survives retries: aiokafka keeps at most one produce request in flight
per broker and mutes a partition while its batch is in flight, and with idempotence a
retriable failure is retried in place (batches never expire), so a retry can never
overtake a later batch of the same partition. A batch the broker rejects for good leaves
a sequence gap, so the later batches of that partition fail too (OutOfOrderSequence);
those are reported as :class:`ProducerBroken` and the producer is recreated, which again
re-sends them in order.

Partitions are chosen like Kafka's default partitioner (murmur2 of the key), so keyed
records land where any Kafka client would put them; keyless records stick to one random
partition per batch (they carry no order promise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kerr
from aiokafka.partitioner import murmur2

from outbox.daemon import kafka_producer, kafka_refusal, start_kafka
from outbox.errors import BrokerUnavailable, ConfigurationError, TopicMissing
from outbox.settings import OutboxSettings
from relay.errors import ProducerBroken, RecordRejected, RecordTooLarge
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
_KEY_CACHE_LIMIT = 100_000


def classify(exc: BaseException) -> Exception:
    """Map an aiokafka failure to the framework's tree: row-level rejection or transient."""
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
    # index -> error; RecordRejected counts an attempt, TopicMissing delays the row without
    # one, anything else (broker down) neither.
    failed: dict[int, Exception] = field(default_factory=dict)

    @property
    def transient(self) -> Exception | None:
        """The first failure that is not the row's fault (broker down, producer broken)."""
        for exc in self.failed.values():
            if not isinstance(exc, RecordRejected | TopicMissing):
                return exc
        return None


class Publisher:
    """Owns the producer; ``publish(rows)`` returns an :class:`Outcome`, never raises for
    Kafka trouble (that is reported per row)."""

    def __init__(self, settings: OutboxSettings) -> None:
        self._settings = settings
        self._producer: AIOKafkaProducer | None = None
        self._partitions: dict[str, list[int]] = {}
        self._key_partition: dict[str, dict[bytes, int]] = {}
        # Batches whose acks timed out: still queued inside the producer. They double as
        # the probe for "is Kafka back?" (see wait_drained).
        self._outstanding: set[asyncio.Future[Any]] = set()
        self._lock = asyncio.Lock()
        self._missing: set[str] = set()  # topics known to be missing (logged once each)
        # Bumped on every (re)start, so that two pipelines seeing the same broken producer
        # reset it once, not twice.
        self.generation = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Create and connect the producer; raises BrokerUnavailable when Kafka is down."""
        r = self._settings.relay
        producer = kafka_producer(
            self._settings,
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
        try:
            await start_kafka(producer, self._settings)
        except Exception as exc:
            await self._close(producer)
            raise classify(exc) from exc
        self._producer = producer

    @property
    def started(self) -> bool:
        return self._producer is not None

    async def ensure_started(self) -> None:
        """Start the producer unless another pipeline already did."""
        async with self._lock:
            if self._producer is None:
                await self.start()
                self.generation += 1

    async def reset(self, generation: int) -> None:
        """Recreate a broken producer (a new producer id restarts the sequence numbers)."""
        async with self._lock:
            if generation == self.generation and self._producer is not None:
                await self.stop(within=1.0)

    async def stop(self, within: float) -> None:
        producer, self._producer = self._producer, None
        self._partitions.clear()
        self._outstanding.clear()
        if producer is not None:
            await self._close(producer, within)

    @staticmethod
    async def _close(producer: AIOKafkaProducer, within: float = 2.0) -> None:
        # stop() flushes; with Kafka down that would wait forever. Rows not acked are still
        # in the database, so abandoning queued batches loses nothing.
        try:
            await asyncio.wait_for(producer.stop(), within)
        except (TimeoutError, Exception) as exc:
            log.debug("producer stop did not finish cleanly: %s", type(exc).__name__)

    @property
    def has_outstanding(self) -> bool:
        return any(not f.done() for f in self._outstanding)

    async def wait_drained(self, within: float) -> bool:
        """True when no earlier timed-out batch is still waiting for Kafka."""
        self._outstanding = {f for f in self._outstanding if not f.done()}
        if not self._outstanding:
            return True
        await asyncio.wait(self._outstanding, timeout=within)
        self._outstanding = {f for f in self._outstanding if not f.done()}
        return not self._outstanding

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
        assert self._producer is not None
        try:
            await self._partitions_for(self._producer, topic)
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

    def forget_topic(self, topic: str) -> None:
        """Drop cached metadata (after the topic was found missing, or repartitioned)."""
        self._partitions.pop(topic, None)
        self._key_partition.pop(topic, None)

    # -- publishing -------------------------------------------------------------------------------
    async def publish(self, rows: Sequence[ClaimedRow]) -> Outcome:
        """Send ``rows`` (per lane in id order) and wait for their acks."""
        outcome = Outcome()
        producer = self._producer
        if producer is None:
            down: Exception = BrokerUnavailable("Kafka producer not connected")
            outcome.failed = dict.fromkeys(range(len(rows)), down)
            return outcome
        sent: list[tuple[asyncio.Future[Any], list[int]]] = []
        try:
            await asyncio.wait_for(
                self._send(producer, rows, outcome, sent), self._settings.relay.ack_timeout_seconds
            )
        except Exception as exc:  # reported per row below
            failure = classify(exc)
            queued = {i for _, idx in sent for i in idx}
            for i in range(len(rows)):
                if i not in queued and i not in outcome.failed:
                    outcome.failed[i] = failure
        if sent:
            futures = [f for f, _ in sent]
            await asyncio.wait(futures, timeout=self._settings.relay.ack_timeout_seconds)
        for fut, idx in sent:
            if not fut.done():
                self._outstanding.add(fut)
                late = BrokerUnavailable("Kafka did not acknowledge in time")
                outcome.failed.update(dict.fromkeys(idx, late))
            elif fut.cancelled():
                outcome.failed.update(dict.fromkeys(idx, BrokerUnavailable("send cancelled")))
            elif (error := fut.exception()) is not None:
                outcome.failed.update(dict.fromkeys(idx, classify(error)))
            else:
                outcome.acked.extend(idx)
        return outcome

    async def _send(
        self,
        producer: AIOKafkaProducer,
        rows: Sequence[ClaimedRow],
        outcome: Outcome,
        sent: list[tuple[asyncio.Future[Any], list[int]]],
    ) -> None:
        limit = self._settings.max_payload_bytes
        # (topic, partition) -> (builder, row indexes); insertion order = first appearance.
        open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        parts_of: dict[str, list[int] | Exception] = {}
        sticky: dict[str, int] = {}

        async def flush(tp: tuple[str, int]) -> None:
            builder, idx = open_batches.pop(tp)
            fut = await producer.send_batch(builder, tp[0], partition=tp[1])
            sent.append((fut, idx))

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
            if key is None:
                partition = sticky.setdefault(topic, random.choice(parts))
            else:
                partition = self._partition(topic, parts, key)
            tp = (topic, partition)
            current = open_batches.get(tp)
            if current is None:
                current = open_batches[tp] = (producer.create_batch(), [])
            if current[0].append(key=key, value=payload, timestamp=None, headers=headers) is None:
                await flush(tp)
                current = open_batches[tp] = (producer.create_batch(), [])
                # A fresh batch always takes its first record, however large.
                current[0].append(key=key, value=payload, timestamp=None, headers=headers)
            current[1].append(i)
        for tp in list(open_batches):
            await flush(tp)

"""Batch planning: claimed rows packed into Kafka record batches, per partition, in row order.

Partitions are chosen like Kafka's default partitioner (murmur2 of the key), so keyed
records land where any Kafka client would put them; keyless records stick to one random
partition per batch (they carry no order promise). Rows that cannot go now — too large,
topic missing or not ours to write, partition held back after a stall — are reported in the
outcome instead of planned. Records carry the CloudEvents binary-mode headers
(docs/reference/wire-format.md).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence

from outbox.errors import RecordRejected, TopicMissing
from outbox.identifiers import is_kafka_name
from outbox.kafka.client import Producer, RecordBatch
from outbox.kafka.partitioner import key_partition
from relay.errors import PartitionUnavailable, RecordTooLarge
from relay.event import (
    CE_ID,
    CE_TIME,
    CONTENT_TYPE,
    EVENT_TYPE,
    HEADERS,
    KEY,
    PAYLOAD,
    SOURCE,
    TOPIC,
    Event,
)
from relay.kafka.outcome import Outcome
from relay.kafka.partitions import PartitionHealth
from relay.kafka.producer_pool import ProducerPool
from relay.kafka.wording import Wording

log = logging.getLogger("relay.publisher")

_SPEC = b"1.0"
_KEY_CACHE_LIMIT = 100_000

# One partition's share of a publish: its record batches and the row indexes in each.
Batches = list[tuple[RecordBatch, list[int]]]


def _common_headers(
    event_type: str, source: str, ce_time: str, content_type: str | None
) -> list[tuple[str, bytes]]:
    """The CloudEvents headers after ``ce_id``, in the order records carry them."""
    headers = [
        ("ce_type", event_type.encode()),
        ("ce_source", source.encode()),
        ("ce_time", ce_time.encode()),
        ("ce_specversion", _SPEC),
    ]
    if content_type is not None:  # a tombstone has no content to describe
        headers.append(("content-type", content_type.encode()))
    return headers


class BatchPlanner:
    def __init__(
        self,
        max_payload_bytes: int,
        health: PartitionHealth,
        pool: ProducerPool,
        wording: Wording,
    ) -> None:
        self._limit = max_payload_bytes
        self._health = health
        self._pool = pool
        self._wording = wording
        self.partitions: dict[str, list[int]] = {}  # topic -> its partitions, as last asked
        self._key_partition: dict[str, dict[bytes, int]] = {}
        self._missing: set[str] = set()  # topics known to be missing (logged once each)

    def forget(self) -> None:
        self.partitions.clear()

    async def partitions_for(self, producer: Producer, topic: str) -> list[int]:
        """Partitions of ``topic``; TopicMissing when metadata says it does not exist."""
        parts = self.partitions.get(topic)
        if parts is not None:
            return parts
        known = await producer.partitions(topic)
        if known is None and not is_kafka_name(topic):
            # Kafka's answer (INVALID_TOPIC_EXCEPTION) is not kept in aiokafka's metadata:
            # the topic would look missing for ever. The row's own error: it counts.
            raise RecordRejected(f"Kafka rejected the record: {topic!r} is not a valid topic name")
        if known is None:
            if topic not in self._missing:
                self._missing.add(topic)
                log.warning(
                    "Kafka topic missing; its %s (no attempts counted) until it exists: "
                    "outbox topics ensure --topic %s",
                    self._wording.wait,
                    topic,
                    extra={"topic": topic},
                )
            raise TopicMissing(topic)
        if topic in self._missing:
            self._missing.discard(topic)
            log.info(
                "Kafka topic exists now; publishing its %s",
                self._wording.records,
                extra={"topic": topic},
            )
        self.partitions[topic] = known
        return known

    def _partition(self, topic: str, parts: list[int], key: bytes) -> int:
        cache = self._key_partition.setdefault(topic, {})
        p = cache.get(key)
        if p is None:
            if len(cache) > _KEY_CACHE_LIMIT:
                cache.clear()
            p = cache[key] = key_partition(parts, key)
        return p

    def topic_missing(self, topic: str) -> None:
        """Ask Kafka for ``topic`` again next time (its rows went back: it does not exist)."""
        self.partitions.pop(topic, None)
        self._key_partition.pop(topic, None)

    async def plan(
        self, rows: Sequence[Event], outcome: Outcome, claimed_at: float
    ) -> dict[tuple[str, int], Batches]:
        """Pack the rows into record batches per partition (in row order); rows that cannot
        go now (too large, topic missing, partition held back) are reported in ``outcome``.
        ``claimed_at``: the loop time before the claim began (rows of partitions held back
        since then wait)."""
        # Any running producer answers metadata and builds batches (the same for all).
        producer = self._pool.running() or await self._pool.start(0)
        limit = self._limit
        plan: dict[tuple[str, int], Batches] = {}
        refused: dict[tuple[str, int], PartitionUnavailable | None] = {}
        parts_of: dict[str, list[int] | Exception] = {}
        sticky: dict[str, int] = {}
        encoded: dict[tuple[str, str, str, str | None], list[tuple[str, bytes]]] = {}
        for i, row in enumerate(rows):
            topic = row[TOPIC]
            parts = parts_of.get(topic)
            if parts is None:
                try:
                    parts = await self.partitions_for(producer, topic)
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
                refused[tp] = self._health.refusal(tp, claimed_at)
            unavailable = refused[tp]
            if unavailable is not None:
                outcome.failed[i] = unavailable
                continue
            payload: bytes | None = row[PAYLOAD]  # None: a tombstone
            # The headers after ce_id are shared by the rows of a transaction (type,
            # source, time, content type): encoded once per publish.
            shared = (row[EVENT_TYPE], row[SOURCE], row[CE_TIME], row[CONTENT_TYPE])
            common = encoded.get(shared)
            if common is None:
                common = encoded[shared] = _common_headers(*shared)
            headers = [("ce_id", row[CE_ID].encode()), *common]
            size = len(payload or b"") + len(key or b"")
            if row[HEADERS] != "{}":
                extra = [(k, v.encode()) for k, v in json.loads(row[HEADERS]).items()]
                headers.extend(extra)
                size += sum(len(v) for _, v in extra)
            if size > limit:
                outcome.failed[i] = RecordTooLarge(size, limit)
                continue
            batches = plan.get(tp)
            if batches is None:
                self._pool.index_of(tp)  # assigned now, before any delivery looks it up
                batches = plan[tp] = [(producer.new_batch(), [])]
            builder, idx = batches[-1]
            if builder.append(key=key, value=payload, timestamp=None, headers=headers) is None:
                builder, idx = producer.new_batch(), []
                batches.append((builder, idx))
                # A fresh batch always takes its first record, however large.
                builder.append(key=key, value=payload, timestamp=None, headers=headers)
            idx.append(i)
        return plan

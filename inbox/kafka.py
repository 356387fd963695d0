"""The inbox's Kafka plumbing: topic checks, dead-letter topic creation, the DLQ producer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    InvalidProducerEpoch,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    UnknownProducerId,
    for_code,
)

from inbox.errors import RecordTooLargeForTopic
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError, TopicMissing
from outbox.kafka.admin import UNKNOWN_TOPIC, topic_error
from outbox.kafka.clients import kafka_admin, kafka_producer, start_kafka
from outbox.kafka.errors import kafka_refusal, raise_admin_failure
from outbox.ops.record_limits import (
    TopicLimits,
    dead_letter_configs,
    describe_limits,
    header_room,
)
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.inbox")


async def ensure_topics(settings: OutboxSettings, topics: Sequence[str]) -> None:
    """Source topics must exist; their dead-letter topics are created if missing (same
    partition count and replication, the source's record size limit plus room for the
    ``dlq_*`` headers, its compression) when ``consumer.dlq_create`` is on. An existing
    dead-letter topic that takes smaller records than its source is logged."""
    suffix = settings.consumer.dlq_suffix
    admin = kafka_admin(settings)
    try:
        await start_kafka(admin, settings)
        described = {
            d["topic"]: d
            for d in await admin.describe_topics([*topics, *(t + suffix for t in topics)])
        }
        missing: dict[str, tuple[int, int]] = {}  # source -> (partitions, replicas)
        present: list[str] = []  # sources whose dead-letter topic exists
        for found in described.values():
            # Kafka answers a topic this client may not describe with an error, not a raise.
            if found["error_code"] not in (0, UNKNOWN_TOPIC):
                raise _topic_failure(found["topic"], for_code(found["error_code"])())
        for topic in topics:
            source = described.get(topic)
            if source is None or source["error_code"] == UNKNOWN_TOPIC:
                raise TopicMissing(topic)
            dlq = described.get(topic + suffix)
            if dlq is not None and dlq["error_code"] != UNKNOWN_TOPIC:
                present.append(topic)
                continue
            if not settings.consumer.dlq_create:
                raise TopicMissing(topic + suffix)
            partitions = source["partitions"]
            replicas = len(partitions[0]["replicas"]) if partitions else 1
            missing[topic] = (max(len(partitions), 1), replicas)
        try:
            limits, unreadable = await describe_limits(
                admin, [*topics, *(t + suffix for t in present)]
            )
        except KafkaError as exc:  # sizing is worth a try, not a reason to stay down
            limits, unreadable = {}, dict.fromkeys(topics, exc)
        if missing:
            await _create_dead_letter_topics(admin, settings, missing, limits, unreadable)
        for topic in present:
            _check_dead_letter_limit(topic, topic + suffix, limits)
    except KafkaError as exc:
        raise_admin_failure(exc)
    finally:
        await admin.close()


async def _create_dead_letter_topics(
    admin: AIOKafkaAdminClient,
    settings: OutboxSettings,
    missing: dict[str, tuple[int, int]],
    limits: dict[str, TopicLimits],
    unreadable: dict[str, KafkaError],
) -> None:
    suffix, chars = settings.consumer.dlq_suffix, settings.consumer.error_message_chars
    new_topics = []
    for source, (partitions, replicas) in missing.items():
        configs: dict[str, str] = {}
        if source in limits:
            configs = dead_letter_configs(limits[source], chars)
        else:
            # Still worth creating: a dead letter the topic refuses as too large is kept in
            # the database (see inbox/dead_lettering.py), nothing stops.
            log.warning(
                "cannot read the source topic's max.message.bytes (%s); its dead-letter topic "
                "gets the broker's defaults: grant DESCRIBE_CONFIGS on it, or create the "
                "dead-letter topic yourself with the source's limit plus %d bytes",
                type(unreadable.get(source, KafkaError())).__name__,
                header_room(chars),
                extra={"topic": source},
            )
        new_topics.append(NewTopic(source + suffix, partitions, replicas, topic_configs=configs))
    response = await admin.create_topics(new_topics)
    for new_topic in new_topics:
        error = topic_error(response, new_topic.name)
        # Another consumer of the group may have created it first.
        if error is not None and not isinstance(error, TopicAlreadyExistsError):
            raise _topic_failure(new_topic.name, error)
    log.info(
        "created dead-letter topics",
        extra={"topics": {t.name: t.topic_configs for t in new_topics}},
    )


def _check_dead_letter_limit(source: str, dlq: str, limits: dict[str, TopicLimits]) -> None:
    if source not in limits or dlq not in limits:
        return
    have, need = limits[dlq].max_message_bytes, limits[source].max_message_bytes
    if have < need:
        log.warning(
            "dead-letter topic %s takes records up to %d bytes, its source %s up to %d: a "
            "larger dead letter is kept in the database only (a marker goes to the topic); "
            "raise its max.message.bytes",
            dlq,
            have,
            source,
            need,
            extra={"topic": dlq, "max_message_bytes": have, "source_max_message_bytes": need},
        )


def _topic_failure(topic: str, error: KafkaError) -> Exception:
    """A per-topic error of a describe or create answer: refused (exit 2), a permanent
    error (exit 2, named), or trouble worth retrying."""
    name = type(error).__name__
    if isinstance(error, TopicAuthorizationFailedError):
        return BrokerRefused(
            f"Kafka refuses this client topic {topic!r}: {name}; grant it DESCRIBE and "
            "CREATE (dead-letter topics) or create the topic another way"
        )
    if not getattr(error, "retriable", False):
        return ConfigurationError(f"Kafka refuses topic {topic!r}: {name}")
    return BrokerUnavailable(f"Kafka could not answer for topic {topic!r}: {name}")


# A dead letter is a record Kafka already took on its source topic, so only the dead-letter
# topic's own limit should decide whether it fits: the client's check (max_request_size) is
# set far above usual topic limits, and below the brokers' default socket.request.max.bytes
# (100 MiB), past which a broker hangs up instead of answering with an error.
DLQ_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# Answers about the record's size: a dead letter refused so is kept in the database.
_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)
# Answers after which this producer instance cannot send to the partition again.
_BROKEN = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, ProducerClosed)
_CLOSE_SECONDS = 2.0


def dlq_producer(settings: OutboxSettings) -> AIOKafkaProducer:
    # acks=all + idempotence: a dead letter acknowledged once is never lost or doubled by
    # the producer's own retries. Compressed unless the app chose otherwise: a record its
    # producer compressed under the source topic's limit arrives here decompressed.
    return kafka_producer(
        settings,
        acks="all",
        enable_idempotence=True,
        max_request_size=DLQ_MAX_REQUEST_BYTES,
        compression_type=settings.kafka.options.get("compression_type", "gzip"),
    )


async def start_dlq_producer(settings: OutboxSettings) -> AIOKafkaProducer:
    """A started :func:`dlq_producer` (BrokerUnavailable while Kafka cannot be reached)."""
    producer = dlq_producer(settings)
    try:
        await start_kafka(producer, settings)
    except KafkaError as exc:
        await _close(producer)
        raise BrokerUnavailable(f"Kafka unreachable: {type(exc).__name__}") from exc
    except BaseException:
        await _close(producer)
        raise
    return producer


async def _close(producer: AIOKafkaProducer) -> None:
    # stop() flushes what is queued; a broken producer or an absent broker must not hang
    # the caller (whatever was not acknowledged is re-sent by its caller's retry).
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), _CLOSE_SECONDS)


class KafkaSink:
    """Produces records and waits for the ack (dead letters, replays).

    With ``renew``, the sink owns its producer and replaces it when the broker left it
    unusable: a record Kafka refuses (too large) leaves a gap in the idempotent producer's
    sequence numbers, and every later send to that partition would fail with
    OutOfOrderSequenceNumber for ever. A new producer gets a new producer id, so its
    sequences start afresh. Without ``renew`` the caller owns the producer.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        renew: Callable[[], Awaitable[AIOKafkaProducer]] | None = None,
    ) -> None:
        self._producer: AIOKafkaProducer | None = producer
        self._renew = renew
        self._generation = 0
        self._lock = asyncio.Lock()

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _close(producer)  # a hung broker must not hold a stopping consumer

    async def _replace(self, generation: int) -> None:
        """Retire the producer ``generation`` saw fail (once, however many sends saw it);
        the next send starts a new one."""
        if self._renew is None:
            return
        async with self._lock:
            if generation != self._generation:
                return
            self._generation += 1
            old, self._producer = self._producer, None
            if old is not None:
                await _close(old)

    async def _current(self) -> tuple[AIOKafkaProducer, int]:
        async with self._lock:
            if self._producer is None:
                assert self._renew is not None
                self._producer = await self._renew()
            return self._producer, self._generation

    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        producer, generation = await self._current()
        try:
            pending: Any = await producer.send(topic, value, key=key, headers=headers)
            meta = await pending
        except KafkaError as exc:
            refused = kafka_refusal(exc)
            if refused is not None:  # not allowed to write there: no retry will do
                raise refused from None
            if isinstance(exc, TopicAuthorizationFailedError):
                raise BrokerRefused(
                    f"Kafka refuses writes to {topic!r}: {type(exc).__name__}; grant this "
                    "client WRITE on it"
                ) from None
            if isinstance(exc, _TOO_LARGE):
                await self._replace(generation)
                size = len(key or b"") + len(value or b"")
                size += sum(len(n) + len(v) for n, v in headers)
                raise RecordTooLargeForTopic(topic, size, type(exc).__name__) from None
            if isinstance(exc, InvalidTopicError):
                # The record itself is refused: retrying sends the same bytes again. Stop
                # (exit 2); the event stays unhandled, its offset uncommitted.
                raise ConfigurationError(
                    f"Kafka refuses the record on {topic!r}: {type(exc).__name__}"
                ) from None
            if isinstance(exc, _BROKEN):
                await self._replace(generation)  # the retry gets a new producer
            raise BrokerUnavailable(f"producing to {topic!r} failed: {type(exc).__name__}") from exc
        return int(meta.partition), int(meta.offset)

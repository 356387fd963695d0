"""The inbox's Kafka plumbing: topic checks, dead-letter topic creation, the DLQ producer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic
from aiokafka.errors import (
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    for_code,
)

from outbox.daemon import (
    UNKNOWN_TOPIC,
    kafka_admin,
    kafka_producer,
    kafka_refusal,
    start_kafka,
    topic_error,
)
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError, TopicMissing
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.inbox")
_REFUSED_RECORDS = (MessageSizeTooLargeError, RecordTooLargeError, InvalidTopicError)


async def ensure_topics(settings: OutboxSettings, topics: Sequence[str]) -> None:
    """Source topics must exist; their dead-letter topics are created if missing
    (same partition count and replication) when ``consumer.dlq_create`` is on."""
    suffix = settings.consumer.dlq_suffix
    admin = kafka_admin(settings)
    try:
        await start_kafka(admin, settings)
        described = {
            d["topic"]: d
            for d in await admin.describe_topics([*topics, *(t + suffix for t in topics)])
        }
        missing_dlq: list[NewTopic] = []
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
                continue
            if not settings.consumer.dlq_create:
                raise TopicMissing(topic + suffix)
            partitions = source["partitions"]
            replicas = len(partitions[0]["replicas"]) if partitions else 1
            missing_dlq.append(NewTopic(topic + suffix, max(len(partitions), 1), replicas))
        if missing_dlq:
            response = await admin.create_topics(missing_dlq)
            for new_topic in missing_dlq:
                error = topic_error(response, new_topic.name)
                # Another consumer of the group may have created it first.
                if error is not None and not isinstance(error, TopicAlreadyExistsError):
                    raise _topic_failure(new_topic.name, error)
            log.info("created dead-letter topics", extra={"topics": [t.name for t in missing_dlq]})
    except KafkaError as exc:
        refused = kafka_refusal(exc)
        if refused is not None:
            raise refused from None
        raise BrokerUnavailable(f"Kafka admin request failed: {type(exc).__name__}") from exc
    finally:
        await admin.close()


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


def dlq_producer(settings: OutboxSettings) -> AIOKafkaProducer:
    # acks=all + idempotence: a dead letter acknowledged once is never lost or doubled by
    # the producer's own retries.
    return kafka_producer(
        settings,
        acks="all",
        enable_idempotence=True,
        max_request_size=max(settings.max_payload_bytes * 2, 1_048_576),
    )


class KafkaSink:
    """Produces records and waits for the ack (dead letters, replays)."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        try:
            pending: Any = await self._producer.send(topic, value, key=key, headers=headers)
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
            if isinstance(exc, _REFUSED_RECORDS):
                # The record itself is refused: retrying sends the same bytes again. Stop
                # (exit 2) with what to change; the event stays unhandled, its offset
                # uncommitted, so nothing is lost.
                raise ConfigurationError(
                    f"Kafka refuses the record on {topic!r}: {type(exc).__name__}; raise the "
                    "topic's max.message.bytes (and the broker's), or make the event smaller"
                ) from None
            raise BrokerUnavailable(f"producing to {topic!r} failed: {type(exc).__name__}") from exc
        return int(meta.partition), int(meta.offset)

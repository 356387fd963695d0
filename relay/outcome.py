"""What Kafka made of each row of a publish: acknowledged, or failed and why.

The per-row verdicts are the publisher's whole answer (it never raises for Kafka trouble);
the pipeline turns them into row states. ``classify`` maps aiokafka's errors onto the
framework's tree, deciding what counts an attempt and what only delays a row.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiokafka import errors as kerr

from outbox.daemon import kafka_refusal
from outbox.errors import BrokerUnavailable, ConfigurationError, TopicMissing
from relay.errors import PartitionUnavailable, ProducerBroken, RecordRejected

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

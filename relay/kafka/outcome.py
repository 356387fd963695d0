"""What Kafka made of each event of a publish: acknowledged, or failed and why.

The per-event failures are the publisher's whole answer (it never raises for Kafka
trouble); the source carries out the verdict on them (relay/verdict.py). They are the
framework's errors, as the Kafka client interface gives them (outbox/kafka/client.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from outbox.errors import BrokerUnavailable, OutboxError, RecordRejected, TopicMissing
from relay.errors import PartitionUnavailable


def failure_of(exc: BaseException) -> Exception:
    """``exc`` as an outcome records it: the framework's errors as they are; a cancelled
    send, or anything else, is Kafka unavailable (no attempt counted)."""
    if isinstance(exc, OutboxError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return BrokerUnavailable("send cancelled")
    return BrokerUnavailable(f"Kafka unavailable: {type(exc).__name__}")


@dataclass
class Outcome:
    """What happened to each event of one publish call (indexes into the events given)."""

    acked: list[int] = field(default_factory=list)
    # index -> error; RecordRejected counts an attempt, TopicMissing and PartitionUnavailable
    # delay the event without one, anything else (Kafka down) neither.
    failed: dict[int, Exception] = field(default_factory=dict)

    @property
    def transient(self) -> Exception | None:
        """The first failure that concerns Kafka as a whole (unreachable, producer broken);
        rejected events, missing topics and unavailable partitions concern only themselves."""
        for exc in self.failed.values():
            if not isinstance(exc, RecordRejected | TopicMissing | PartitionUnavailable):
                return exc
        return None

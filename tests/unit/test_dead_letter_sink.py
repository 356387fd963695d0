"""How a failed dead-letter produce is classified: only what a retry can fix is retried.

A record Kafka refuses (too large) or a topic this client may not write would otherwise be
retried forever, stalling the partition with no word of why.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from inbox.kafka import KafkaSink
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError


class _Producer:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


@pytest.mark.parametrize(
    ("error", "raised", "says"),
    [
        (MessageSizeTooLargeError(), ConfigurationError, "max.message.bytes"),
        (TopicAuthorizationFailedError(), BrokerRefused, "TopicAuthorizationFailedError"),
        (KafkaTimeoutError(), BrokerUnavailable, "KafkaTimeoutError"),
    ],
)
async def test_a_failed_dead_letter_is_retried_only_when_a_retry_can_help(
    error: Exception, raised: type[Exception], says: str
) -> None:
    sink = KafkaSink(_Producer(error))  # type: ignore[arg-type]
    with pytest.raises(raised, match=says) as caught:
        await sink.send("orders.dlq", b"k", b"v", [])
    assert caught.value.retriable is (raised is BrokerUnavailable)  # type: ignore[attr-defined]

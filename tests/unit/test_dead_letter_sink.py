"""How a failed dead-letter produce is classified: only what a retry can fix is retried.

A record Kafka refuses (too large) or a topic this client may not write would otherwise be
retried forever, stalling the partition with no word of why.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)

from inbox.dead_lettering import DeadLetterer
from inbox.errors import RecordTooLargeForTopic
from inbox.event import InboxEvent
from inbox.failures import Failure
from inbox.kafka import KafkaSink
from inbox.metrics import Metrics
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError
from outbox.settings import ConsumerSettings


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


class _Recorded:
    """A producer that answers each send from a script: an error to raise, or success."""

    def __init__(self, *answers: Exception | None) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, bytes | None]] = []
        self.stopped = False

    async def send(self, topic: str, value: bytes | None, **kwargs: Any) -> Any:
        # Queued at once, answered a moment later (as the broker's ack or refusal).
        answer = self.answers.pop(0)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if answer is not None:
            asyncio.get_running_loop().call_soon(done.set_exception, answer)
        else:
            self.sent.append((topic, value))
            meta = SimpleNamespace(partition=0, offset=len(self.sent) - 1)
            asyncio.get_running_loop().call_soon(done.set_result, meta)
        return done

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (MessageSizeTooLargeError(), RecordTooLargeForTopic),
        (RecordListTooLargeError(), RecordTooLargeForTopic),
        (OutOfOrderSequenceNumber(), BrokerUnavailable),
    ],
)
async def test_a_producer_a_refusal_left_unusable_is_replaced_once(
    error: Exception, raised: type[Exception]
) -> None:
    # A refused record leaves a gap in the idempotent producer's sequence numbers: every
    # later send to that partition would fail. The sink retires that producer (once, even
    # when several sends saw it fail) and the next send gets a new one.
    first, second = _Recorded(error, error), _Recorded(None)
    made: list[_Recorded] = []

    async def renew() -> Any:
        made.append(second)
        return second

    sink = KafkaSink(first, renew=renew)  # type: ignore[arg-type]
    failures = await asyncio.gather(
        sink.send("orders.dlq", b"k", b"v" * 100, [("h", b"x")]),
        sink.send("orders.dlq", b"k", b"v", []),
        return_exceptions=True,
    )
    assert [type(f) for f in failures] == [raised, raised]
    if raised is RecordTooLargeForTopic:
        assert isinstance(failures[0], RecordTooLargeForTopic)
        assert failures[0].size == 1 + 100 + 2 and failures[0].topic == "orders.dlq"
    assert first.stopped and made == []  # retired; the new one starts on the next send
    assert await sink.send("orders.dlq", b"k", b"", []) == (0, 0)
    assert made == [second] and second.sent == [("orders.dlq", b"")]
    await sink.stop()
    assert second.stopped


class _Sink:
    def __init__(self, *answers: Exception | None) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[bytes | None, dict[str, bytes]]] = []

    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer
        self.sent.append((value, dict(headers)))
        return 3, 7


class _Store:
    def __init__(self) -> None:
        self.letters: list[dict[str, Any]] = []

    async def claim(self, *args: Any, **kwargs: Any) -> set[str]:
        return {"e-1"}

    async def add_dead_letter(self, *args: Any, **kwargs: Any) -> None:
        self.letters.append(kwargs)


def _event() -> InboxEvent:
    return InboxEvent(
        event_id="e-1",
        event_type="order.created",
        topic="orders",
        partition=0,
        offset=41,
        key=b"k",
        value=b"x" * 5000,
        headers=(("ce_id", b"e-1"), ("ce_type", b"order.created")),
    )


@pytest.mark.parametrize("marker_fits", [True, False])
async def test_a_dead_letter_too_large_for_its_topic_is_kept_with_a_marker(
    marker_fits: bool,
) -> None:
    too_large = RecordTooLargeForTopic("orders.dlq", 5100, "MessageSizeTooLargeError")
    sink = _Sink(too_large, None if marker_fits else too_large)
    store = _Store()
    metrics = Metrics("billing")
    dead = DeadLetterer("billing", ConsumerSettings(), store, sink, metrics)  # type: ignore[arg-type]
    failure = Failure("Permanent", "no", retryable=False)
    assert await dead.send(None, _event(), failure, attempts=1)  # type: ignore[arg-type]
    [letter] = store.letters
    assert letter["dlq_refused"] == "MessageSizeTooLargeError"
    where = (letter["dlq_partition"], letter["dlq_offset"])
    assert where == ((3, 7) if marker_fits else (None, None))
    if marker_fits:
        [(value, headers)] = sink.sent
        assert value == b"" and "ce_id" not in headers
        assert headers["dlq_event_id"] == b"e-1" and headers["dlq_value_bytes"] == b"5000"
        assert headers["dlq_stored_in"] == b"database" and headers["dlq_attempts"] == b"1"
    assert metrics.dead_letter_refused("orders.dlq") == 2  # the send counted the first

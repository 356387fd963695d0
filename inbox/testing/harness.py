"""Deliver events to a consumer app's handlers through the real processing path, without
Kafka: inbox dedupe, error classification, attempts, retries and dead letters are the
daemon's own (:class:`~inbox.processor.PartitionProcessor`), run against the user's
database. Only the dead-letter topic is replaced by a list that records what would have
been produced.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.pool import NullPool

from inbox.app import Consumer
from inbox.connections import Connections
from inbox.envelopes.base import EVENT_ID_HEADER
from inbox.event import InboxEvent, header_text
from inbox.metrics import Metrics
from inbox.processor import PartitionProcessor
from inbox.store import InboxStore
from outbox.db import async_engine
from outbox.envelope import SEQUENCE_HEADER, TOMBSTONE, Payload, encode_payload
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from outbox.testing import PublishedEvent

Outcome = Literal["handled", "duplicate", "dead_lettered", "skipped", "stale"]


@dataclass(frozen=True)
class DeadLetterRecord:
    """What would have been produced to the dead-letter topic."""

    topic: str
    event_id: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header(self, name: str) -> str | None:
        return header_text(self.headers, name)

    @property
    def error_class(self) -> str:
        return self.header("dlq_error_class") or ""

    @property
    def error_message(self) -> str:
        return self.header("dlq_error_message") or ""

    @property
    def attempts(self) -> int:
        return int(self.header("dlq_attempts") or 0)

    def json(self) -> Any:
        """The original value parsed as JSON."""
        return json.loads(self.value or b"null")


@dataclass(frozen=True)
class Delivery:
    """What one :meth:`InboxHarness.deliver` did with the event."""

    event: InboxEvent
    outcome: Outcome
    # Handler runs this delivery made (retries included); 0 for duplicates and skips.
    runs: int
    dead_letter: DeadLetterRecord | None = None


@dataclass(frozen=True)
class BatchDelivery:
    """What one :meth:`InboxHarness.deliver_batch` did with its events."""

    events: tuple[InboxEvent, ...]
    # The consumer's counters moved by the delivery: processed, duplicates, dead_lettered,
    # skipped, stale, retries, transactions.
    counts: Mapping[str, int]
    # Calls of batch handlers it made (splits after a failure included).
    calls: int
    dead_letters: tuple[DeadLetterRecord, ...]

    @property
    def handled(self) -> int:
        """Events whose handler committed."""
        return self.counts["processed"]


@dataclass(frozen=True)
class Record:
    """A Kafka record as some producer wrote it (from :meth:`InboxHarness.record`): a
    delivery reads it through the app's envelope for its topic, as the daemon does."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    partition: int = 0
    offset: int = -1
    timestamp: int = 0


@dataclass
class _RecordingSink:
    records: list[DeadLetterRecord] = field(default_factory=list)

    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        event_id = header_text(headers, EVENT_ID_HEADER) or ""
        self.records.append(DeadLetterRecord(topic, event_id, key, value, tuple(headers)))
        return 0, len(self.records) - 1


class InboxHarness:
    """``deliver`` events to ``app`` one at a time, as the consumer daemon would.

    Use ``InboxHarness(app, settings)`` (or the pytest plugin's ``inbox_harness``
    fixture); ``close()`` (or ``async with``) lets go of the partitions and the engines.
    Each delivery gets the next offset of one partition of the event's topic, so
    delivering the same event twice is a redelivery: the second is a duplicate. Retries
    do not wait (backoff 0); ``max_attempts`` is the settings' or the handler's, as in
    production.
    """

    def __init__(self, app: Consumer, settings: OutboxSettings, *, partition: int = 0) -> None:
        self.app = app
        self.settings = settings
        self.partition = partition
        self.dead_letters: list[DeadLetterRecord] = []
        self._sink = _RecordingSink(self.dead_letters)
        self.metrics = Metrics(app.name)
        self._store = InboxStore(build_tables(settings))
        self._engine: AsyncEngine | None = None
        self._autocommit: AsyncEngine | None = None
        self._connections: Connections | None = None
        self._processors: dict[str, PartitionProcessor] = {}
        # Offsets grow across harnesses too (a time base): the durable attempt marker of an
        # earlier test run must never look like a run of this one.
        self._next_offset = time.time_ns() // 1000

    async def __aenter__(self) -> InboxHarness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for processor in self._processors.values():
            await processor.release()
        self._processors.clear()
        if self._connections is not None:
            await self._connections.close()
            self._connections = None
        for engine in (self._engine, self._autocommit):
            if engine is not None:
                await engine.dispose()
        self._engine = self._autocommit = None

    def event(
        self,
        event_type: str,
        payload: Payload,
        *,
        key: str | bytes | None = None,
        event_id: str | uuid.UUID | None = None,
        topic: str | None = None,
        headers: Mapping[str, str] | None = None,
        sequence: int | None = None,
    ) -> InboxEvent:
        """An event as the relay would put it on Kafka (CloudEvents binary headers);
        ``payload=outbox.TOMBSTONE`` makes a tombstone (null value, no content type)."""
        value, content_type = encode_payload(payload)
        all_headers = [
            ("ce_id", str(event_id or uuid.uuid4()).encode()),
            ("ce_type", event_type.encode()),
            ("ce_source", b"urn:test"),
            ("ce_specversion", b"1.0"),
            *([("content-type", content_type.encode())] if content_type is not None else []),
            *((name, text.encode()) for name, text in (headers or {}).items()),
        ]
        if sequence is not None:
            all_headers.append((SEQUENCE_HEADER, f"{sequence:020d}".encode()))
        return InboxEvent(
            event_id=all_headers[0][1].decode(),
            event_type=event_type,
            topic=topic or self.app.topics[0],
            partition=self.partition,
            offset=-1,
            key=key.encode() if isinstance(key, str) else key,
            value=value,
            headers=tuple(all_headers),
            timestamp_ms=time.time_ns() // 1_000_000,
        )

    def record(
        self,
        value: Payload | None,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        topic: str | None = None,
    ) -> Record:
        """A record as another producer would write it (a Debezium outbox router, a
        structured-mode CloudEvents SDK, a plain JSON producer): ``deliver`` reads it
        through the app's envelope, so a record it cannot read is malformed here too."""
        raw = value if value is None else encode_payload(value)[0]
        return Record(
            topic=topic or self.app.topics[0],
            key=key.encode() if isinstance(key, str) else key,
            value=raw,
            headers=tuple(
                (name, text.encode() if isinstance(text, str) else text)
                for name, text in (headers or {}).items()
            ),
        )

    async def deliver(
        self,
        event: InboxEvent | PublishedEvent | Record | str,
        payload: Payload | None = None,
        **fields: Any,
    ) -> Delivery:
        """Deliver ``event`` and handle it to the end: committed, skipped as a duplicate,
        or dead-lettered after its attempts. ``event`` is an :class:`InboxEvent` (from
        :meth:`event`), a :class:`Record` (from :meth:`record`), an event a unit of work
        published (:mod:`outbox.testing`: the producer's side and the consumer's tested
        together), or an event type with its payload and :meth:`event`'s keyword
        arguments."""
        offset = self._next_offset
        self._next_offset += 1
        if isinstance(event, Record):
            placed = replace(
                event, partition=self.partition, offset=offset, timestamp=time.time_ns() // 10**6
            )
            event = self.app.decoder(event.topic)(placed)
        elif isinstance(event, PublishedEvent):
            event = self._from_outbox(event)
        elif isinstance(event, str):
            if payload is None:
                raise TypeError("deliver(event_type, payload, ...) needs a payload")
            event = self.event(event, payload, **fields)
        event = replace(event, offset=offset)
        counts, dead_letters = await self._run([event])
        dead = dead_letters[0] if dead_letters else None
        return Delivery(event, _outcome(counts), _runs(counts, dead), dead)

    async def deliver_batch(self, events: Sequence[InboxEvent]) -> BatchDelivery:
        """Deliver ``events`` (from :meth:`event`) at once, at consecutive offsets of one
        partition, as one fetch brings them: a batch handler gets them in lists (up to its
        ``max_batch``), exactly as the daemon calls it, and a failing call is split the
        same way. Returns what became of them, counted."""
        if not events:
            raise ValueError("deliver_batch needs at least one event")
        if len({e.topic for e in events}) > 1:
            raise ValueError("deliver_batch takes the events of one topic")
        placed = []
        for event in events:
            placed.append(replace(event, offset=self._next_offset))
            self._next_offset += 1
        calls = self.metrics.batch_calls
        counts, dead_letters = await self._run(placed)
        return BatchDelivery(
            events=tuple(placed),
            counts=counts,
            calls=self.metrics.batch_calls - calls,
            dead_letters=tuple(dead_letters),
        )

    async def _run(self, events: list[InboxEvent]) -> tuple[dict[str, int], list[DeadLetterRecord]]:
        """Process ``events`` (one topic, rising offsets) to the end: the metric counts
        they moved and the dead letters they produced."""
        processor = self._processor(events[0].topic)
        before = dict(self.metrics.counts)
        letters = len(self.dead_letters)
        pending = list(events)

        def queued(after: int, limit: int) -> Sequence[InboxEvent]:
            return [e for e in pending if e.offset > after][:limit]

        async def progressed(next_offset: int) -> None:
            pending[:] = [e for e in pending if e.offset >= next_offset]

        processor.on_progress = progressed
        try:
            while pending:
                await processor.process(queued)
            await processor.release()
        finally:
            await self._hot().close()  # nothing stays connected between deliveries
        counts = {k: v - before[k] for k, v in self.metrics.counts.items()}
        return counts, self.dead_letters[letters:]

    def _from_outbox(self, event: PublishedEvent) -> InboxEvent:
        headers = dict(event.headers)
        sequence = headers.pop(SEQUENCE_HEADER, None)
        return self.event(
            event.event_type,
            TOMBSTONE if event.payload is None else event.payload,
            key=event.key,
            event_id=event.event_id,
            topic=event.topic,
            headers=headers,
            sequence=None if sequence is None else int(sequence),
        )

    def _engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        # No pool: nothing stays connected between deliveries, so a harness needs no
        # closing and works under any event loop a test runner gives each test.
        if self._engine is None or self._autocommit is None:
            self._engine = async_engine(self.settings, poolclass=NullPool)
            self._autocommit = async_engine(
                self.settings, poolclass=NullPool, isolation_level="AUTOCOMMIT"
            )
        return self._engine, self._autocommit

    def _hot(self) -> Connections:
        if self._connections is None:
            self._connections = Connections(self._engines()[1])
        return self._connections

    def _processor(self, topic: str) -> PartitionProcessor:
        processor = self._processors.get(topic)
        if processor is None:
            config = self.settings.consumer
            processor = self._processors[topic] = PartitionProcessor(
                app=self.app,
                config=config,
                store=self._store,
                sessions=async_sessionmaker(self._engines()[0], expire_on_commit=False),
                connections=self._hot(),
                sink=self._sink,
                # No waiting between attempts: the count and the classification are real.
                policy=RetryPolicy(0.001, 0.001, config.max_attempts, rng=lambda a, b: 0.0),
                metrics=self.metrics,
                topic=topic,
                partition=self.partition,
            )
        return processor

    async def status(self, event: InboxEvent | str) -> str | None:
        """The event's inbox row status for this consumer (None if it has none)."""
        event_id = event if isinstance(event, str) else event.event_id
        async with AsyncSession(self._engines()[0]) as session:
            return await self._store.inbox_status(session, self.app.name, event_id)


def _outcome(counts: Mapping[str, int]) -> Outcome:
    for name, outcome in (
        ("dead_lettered", "dead_lettered"),
        ("duplicates", "duplicate"),
        ("skipped", "skipped"),
        ("stale", "stale"),
    ):
        if counts[name]:
            return outcome  # type: ignore[return-value]
    return "handled"


def _runs(counts: Mapping[str, int], dead: DeadLetterRecord | None) -> int:
    if dead is not None:
        return dead.attempts
    if counts["processed"]:
        return counts["retries"] + 1
    return 0

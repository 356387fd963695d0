"""Dead-lettering one event: produce the original record to ``<topic>.dlq`` with error
headers, record it in the ``dead_letters`` table, and mark its inbox row, in the caller's
transaction. Also the skip-or-dead-letter policy for unknown types and malformed records.

A dead letter the dead-letter topic refuses as too large (a topic someone else made with a
smaller ``max.message.bytes`` than its source) must not stop the partition: the table
keeps the full record (key, value, headers) whatever Kafka says, so the event is recorded
there with the refusal, and a *marker* — the key and the ``dlq_*`` headers, no value, no
original headers — goes to the topic instead, naming where the record is. The refusal is
counted and logged once per topic with what to change. ``outbox dlq`` lists, shows and
replays such letters from the table like any other.

The table also keeps why the event failed: every failed attempt that led to the dead
letter (time, error, the stack trace and first application frame the failure carries,
this member's host, pid and instance id, how long the attempt ran), appended to what an
earlier delivery left (a replay that fails again adds its attempts; the first failure is
never overwritten). The WARNING line says the message and where it failed, bounded.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from inbox import failures, traces, tracing
from inbox.deadletters import REPLAY_HEADER
from inbox.envelopes.base import EVENT_ID_HEADER
from inbox.errors import RecordTooLargeForTopic
from inbox.event import InboxEvent
from inbox.failures import Failure
from inbox.metrics import Metrics
from inbox.sql import DEAD_LETTERED
from inbox.store import InboxStore
from outbox.ops.deadletters import Attempt
from outbox.ops.record_limits import header_room
from outbox.settings import ConsumerSettings

log = logging.getLogger("outbox.inbox")


class DeadLetterSink(Protocol):
    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        """Produce one record and wait for the broker's ack; return (partition, offset)."""
        ...


@dataclass(frozen=True)
class DeadLetterer:
    consumer: str
    config: ConsumerSettings
    store: InboxStore
    sink: DeadLetterSink
    metrics: Metrics
    # Who this member is, for the attempt history.
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    instance: str | None = field(init=False, default=None)  # the group instance id

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance", self.config.instance_id(self.host))

    def history(
        self, event: InboxEvent, failures_: Sequence[Failure], attempts: int
    ) -> list[dict[str, Any]]:
        """The attempts behind this dead letter, as the table keeps them: the last one is
        attempt ``attempts`` of this delivery (0: refused before any handler ran)."""
        replay = _replay_number(event)
        first = attempts - len(failures_) + 1
        return [
            Attempt(
                at=dt.datetime.fromtimestamp(f.at, dt.UTC),
                attempt=max(0, first + i),
                replay=replay,
                error_class=f.error_class,
                message=f.message,
                frame=f.frame,
                trace=f.trace,
                host=self.host,
                pid=self.pid,
                instance=self.instance,
                seconds=None if f.seconds is None else round(f.seconds, 6),
            ).to_json()
            for i, f in enumerate(failures_)
        ]

    async def apply_policy(self, session: AsyncSession, event: InboxEvent) -> bool:
        """Unknown type or malformed record: dead-letter or skip. True if dead-lettered."""
        if event.malformed is not None:
            failure = failures.malformed(event.malformed, self.config.error_message_chars)
            policy = self.config.malformed_policy
        else:
            failure = failures.unknown_type(event.event_type, event.topic)
            policy = self.config.unknown_type_policy
        if policy == "skip":
            log.debug(
                "skipped",
                extra={
                    "event_id": event.event_id,
                    "topic": event.topic,
                    "partition": event.partition,
                    "reason": failure.message,
                },
            )
            return False
        return await self.send(session, event, failure, attempts=0)

    async def send(
        self,
        session: AsyncSession,
        event: InboxEvent,
        failure: Failure,
        attempts: int,
        history: Sequence[Failure] = (),
    ) -> bool:
        """Send the original record to the DLQ and record it, in ``session``'s transaction.
        ``history``: the failed attempts of this delivery, oldest first, ending with
        ``failure`` (default: ``failure`` alone).

        The inbox row is claimed first: a duplicate is not dead-lettered twice. The produce
        is acknowledged before the commit; a crash in between re-sends it (the DLQ topic is
        at-least-once; the dead_letters table, keyed by event id, is the source of truth).
        """
        claimed = await self.store.claim(
            session,
            self.consumer,
            [event],
            status=DEAD_LETTERED,
            attempts=attempts,
            last_error=failure.text(),
        )
        if not claimed:
            return False
        dlq_topic = event.topic + self.config.dlq_suffix
        dlq = [
            ("dlq_error_class", failure.error_class.encode()),
            ("dlq_error_message", failure.message.encode()),
            ("dlq_attempts", str(attempts).encode()),
            ("dlq_consumer", self.consumer.encode()),
            ("dlq_original_topic", event.topic.encode()),
            ("dlq_original_partition", str(event.partition).encode()),
            ("dlq_original_offset", str(event.offset).encode()),
            (EVENT_ID_HEADER, event.event_id.encode()),
        ]
        refused: RecordTooLargeForTopic | None = None
        at: tuple[int, int] | None
        # The record as received (a structured CloudEvent whole, not only its data).
        value = event.record_value
        try:
            # A replayed record carries the id header already: once is enough.
            kept = [h for h in event.headers if h[0] != EVENT_ID_HEADER]
            at = await self.sink.send(dlq_topic, event.key, value, [*kept, *dlq])
        except RecordTooLargeForTopic as exc:
            refused = exc
            at = await self._send_marker(event, exc, dlq)
        tracing.dead_lettered(event, self.consumer, failure, attempts, dlq_topic)
        await self.store.add_dead_letter(
            session,
            self.consumer,
            event,
            error_class=failure.error_class,
            error_message=failure.message,
            attempts=attempts,
            dlq_topic=dlq_topic,
            dlq_partition=at[0] if at else None,
            dlq_offset=at[1] if at else None,
            dlq_refused=refused.error if refused else None,
            history=self.history(event, history or (failure,), attempts),
        )
        where = {"where": failure.frame} if failure.frame else {}
        trace = {"trace": traces.summary(failure.trace)} if failure.trace else {}
        log.warning(
            "dead-lettered",
            extra={
                "consumer": self.consumer,
                "event_id": event.event_id,
                "topic": event.topic,
                "partition": event.partition,
                "offset": event.offset,
                "error": failure.error_class,
                "error_message": failure.message,
                **where,
                **trace,
                "attempts": attempts,
                **({"dlq_refused": refused.error} if refused else {}),
            },
        )
        return True

    async def _send_marker(
        self, event: InboxEvent, refused: RecordTooLargeForTopic, dlq: list[tuple[str, bytes]]
    ) -> tuple[int, int] | None:
        """The dead-letter topic refused the record as too large: count and report it, and
        send the marker (None when even that is refused; the table has the record)."""
        if self.metrics.dead_letter_refused(refused.topic) == 1:
            log.warning(
                "dead-letter topic %s refuses a record of %d bytes (%s): such records are "
                "kept in the database (outbox dlq list --consumer %s --topic %s), a marker "
                "without the value goes to the topic. Raise the topic's max.message.bytes to "
                "its source topic's plus %d bytes (outbox doctor compares them)",
                refused.topic,
                refused.size,
                refused.error,
                self.consumer,
                event.topic,
                header_room(self.config.error_message_chars),
                extra={"topic": refused.topic, "consumer": self.consumer, "error": refused.error},
            )
        marker = [
            *dlq,
            ("dlq_value_bytes", str(len(event.record_value or b"")).encode()),
            ("dlq_stored_in", b"database"),
        ]
        try:
            return await self.sink.send(refused.topic, event.key, b"", marker)
        except RecordTooLargeForTopic:
            return None


def _replay_number(event: InboxEvent) -> int:
    """Which replay this delivery is (the ``dlq_replay`` header), 0 for the original."""
    for name, value in event.headers:
        if name == REPLAY_HEADER:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0

"""One assigned partition's lane, and the small interface it has to its daemon.

A lane holds its partition's fetched records until they are finished, in offset order.
Short runs are offered to the daemon's sharer (one shared transaction for the runs of many
lanes); what cannot share (a backlog longer than a transaction, a retry after an outage, a
marker to read first, a quiet spell to end, a stop) runs in the lane's own task, in one of
the daemon's slots (``max_concurrent_partitions``, :class:`Slots`). A lane far behind, in
records or bytes, pauses its partition's fetching until it has caught up.

Lanes that are behind never hold back those that are not (issue 52). After a broker's
failover the partitions it stalled arrive with seconds of backlog at once, often more of
them than there are slots; a lane used to keep its slot for up to 4 x max_batch_records
records, across transactions, and the sharer waited for a slot like any lane: the
partitions that had never been behind waited until a backlog drained (a 40 s wait for a
slot measured on a loaded host, clear partitions 57 s behind while the sick broker's own
were 22 s behind). Now the sharer has no slot to wait for (its one transaction has a
connection of its own), and a lane gives its slot back after each transaction while
another lane waits for one, so that lanes behind take turns.

The lane sees its daemon only through :class:`LaneHost`: the consumer settings, the slots,
the retry policy, the two dependencies whose outages it reports, and four callbacks
(offer to the sharer, an offset finished, pause and resume fetching).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaError

from inbox.app import Decoder
from inbox.event import InboxEvent
from inbox.failures import infrastructure_cause, is_infrastructure
from inbox.processor import PartitionProcessor
from outbox.errors import BrokerUnavailable
from outbox.kafka.client import Partition as TopicPartition
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from outbox.settings import ConsumerSettings

log = logging.getLogger("outbox.inbox")


class Slots:
    """The lanes' processing slots (``max_concurrent_partitions``), handed out in turn:
    ``async with slots`` waits for one (first come, first served); :meth:`wanted` says
    whether a lane waits, so that the holder gives its slot back between transactions."""

    def __init__(self, count: int) -> None:
        self._free = asyncio.Semaphore(count)
        self._waiting = self._held = 0

    async def __aenter__(self) -> None:
        self._waiting += 1
        try:
            await self._free.acquire()
        finally:
            self._waiting -= 1
        self._held += 1

    async def __aexit__(self, *exc: object) -> None:
        self._held -= 1
        self._free.release()

    def wanted(self) -> bool:
        return self._waiting > 0

    def in_use(self) -> bool:
        """Whether a lane runs on its own (or waits to): some partition is behind."""
        return self._held > 0 or self._waiting > 0


@dataclass(frozen=True)
class LaneHost:
    """What a lane may use of its daemon, and nothing else."""

    config: ConsumerSettings
    # Lanes' own tasks hold one while handling records (the max_concurrent_partitions
    # bound); the sharer needs none.
    slots: Slots
    policy: RetryPolicy  # the backoff after an outage
    # Shared by every lane: one log line per outage, not one per partition and try.
    database: Dependency
    kafka: Dependency
    offer: Callable[[Lane], None]  # the lane has records for the sharer
    finished: Callable[[TopicPartition, int], None]  # offset committed in the database
    pause: Callable[[TopicPartition], None]  # stop fetching the partition (backpressure)
    resume: Callable[[TopicPartition], None]  # fetch it again

    def dependency_of(self, exc: BaseException) -> Dependency:
        """Which service a transient error is about (the DLQ producer's are Kafka's)."""
        if isinstance(exc, BrokerUnavailable | KafkaError):
            return self.kafka
        return self.database


@dataclass
class Lane:
    """One assigned partition: its fetched records, handled in offset order by the sharer
    (short runs) or by the lane's own task (see the module docstring)."""

    host: LaneHost
    tp: TopicPartition
    processor: PartitionProcessor
    decode: Decoder  # the topic's envelope (inbox/envelopes), resolved once
    events: list[InboxEvent] = field(default_factory=list)  # fetched, not finished
    # Set when the lane's own task has work: a run the sharer cannot take, a retry, a
    # quiet spell to end, or a stop.
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # Set while this lane's records are handled, by its own task or a shared transaction
    # (set and tested without an await in between: no lock needed on one event loop).
    busy: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    position: int = -1
    paused: bool = False
    fetched_bytes: int = 0  # payload bytes of `events`
    # When records last came or were finished (the quiet spell's clock), and whether one
    # has just ended (see sweep()).
    active_at: float = field(default_factory=time.monotonic)
    resting: bool = False

    def feed(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        # ENVELOPE HOOK: where records become InboxEvents (inbox/envelopes; the default,
        # CloudEvents, is inbox/envelopes/cloudevents.py decode).
        fresh = list(map(self.decode, records))
        self.events.extend(fresh)
        self.fetched_bytes += _payload_bytes(fresh)
        self.active_at = time.monotonic()
        if not self.busy:  # else whoever holds it offers what it leaves (settle())
            self.host.offer(self)
        # Backpressure: stop fetching this partition while it is far behind, in records
        # or in bytes (large records).
        config = self.host.config
        behind = len(self.events) >= config.max_batch_records * 4
        if (behind or self.fetched_bytes >= config.max_fetched_bytes) and not self.paused:
            self.host.pause(self.tp)
            self.paused = True

    def queued(self, after: int, limit: int) -> list[InboxEvent]:
        """Up to ``limit`` fetched events with an offset above ``after`` (the processor
        reads ahead to arm its next run while the current one is handled)."""
        start = bisect.bisect_right(self.events, after, key=_offset)
        return self.events[start : start + limit]

    async def progress(self, offset: int) -> None:
        """Records before ``offset`` committed in the database (after each transaction):
        drop them now, not when the run of several transactions ends, so that a paused
        partition is fetched again while the rest of its backlog is handled."""
        self.position = offset
        self.host.finished(self.tp, offset)
        self._trim()

    def settle(self) -> None:
        """Whoever held the lane let go: drop what is finished, and offer the rest (a
        stop, an error or more records) to the sharer, unless the own task takes it."""
        self.busy = False
        self.idle.set()
        self._trim()
        self.active_at = time.monotonic()
        if self.events and not self.wake.is_set():
            self.host.offer(self)

    def sweep(self, now: float, rest: float) -> None:
        """Called now and then by the fetch loop: end a quiet spell of ``rest`` seconds by
        disarming the attempt marker the last commit armed ahead (in the lane's task)."""
        if (
            not self.busy
            and not self.events
            and now - self.active_at >= rest
            and self.processor.armed_ahead
        ):
            self.resting = True
            self.wake.set()

    async def work(self) -> None:
        stopping = self.processor.stopping
        failures = 0
        down: Dependency | None = None
        while not stopping.is_set():
            await self.wake.wait()
            self.wake.clear()
            if self.resting:
                self.resting = False
                await self._rest()  # records that came meanwhile are offered to the sharer
                continue
            if not self.events:
                continue
            async with self.host.slots:
                await self._wait_idle()
                if stopping.is_set():
                    break
                if not self.events:
                    continue  # a shared transaction finished them
                self.busy = True
                try:
                    # One transaction at a time while another lane waits for a slot: the
                    # rest goes round the sharer (which hands it back) to the queue's end.
                    await self.processor.process(self.queued, self.host.slots.wanted)
                    # Any lane's success says the database is back (the lane that saw it
                    # go may have lost its partition meanwhile).
                    self.host.database.ok()
                    if failures and down is self.host.kafka:
                        self.host.kafka.ok()
                    failures = 0
                except Exception as exc:
                    if not is_infrastructure(exc):
                        raise
                    failures += 1
                    delay = self.host.policy.backoff(min(failures, 10))
                    down = self.host.dependency_of(exc)
                    down.failed(infrastructure_cause(exc))
                    self.wake.set()  # try again on its own after the backoff
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), delay)
                finally:
                    self.settle()
        await self._wait_idle()  # a shared transaction may still hold this partition's run
        # If this fails, the next owner takes the armed marker for a crash: slower, still safe.
        # In a slot: a rebalance or a stop lets go of every partition at once.
        async with self.host.slots:
            await self._disarm()

    async def _rest(self) -> None:
        """The partition went quiet: disarm the marker its last commit armed ahead, so that
        a crash of this process (say, a handler of another partition killing it) does not
        make this partition look as if a batch had died in it."""
        async with self.host.slots:  # partitions go quiet together: not all at once
            if self.busy or self.events:
                return
            self.busy = True
            try:
                # If this fails, the next commit, quiet spell or release tries again.
                await self._disarm()
            finally:
                self.settle()

    async def _disarm(self) -> None:
        try:
            await self.processor.release()
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            log.warning(
                "could not disarm the attempt marker",
                extra={"partition": str(self.tp), "error": type(exc).__name__},
            )

    async def _wait_idle(self) -> None:
        while self.busy:
            self.idle.clear()
            await self.idle.wait()

    def _trim(self) -> None:
        """Drop what is finished; the rest (a stop or an error) is tried again.

        A paused partition resumes at half the pause mark (2 x max_batch_records records
        left, half of max_fetched_bytes): two transactions' worth are still queued while
        the next fetch is under way, so the lane does not run dry waiting for it (a
        backlog is then fetched and handled at once, not in turns)."""
        done = bisect.bisect_left(self.events, self.position, key=_offset)
        if done:
            self.fetched_bytes -= _payload_bytes(self.events[:done])
            del self.events[:done]
        config = self.host.config
        if (
            self.paused
            and len(self.events) <= config.max_batch_records * 2
            and self.fetched_bytes < config.max_fetched_bytes // 2
        ):
            self.paused = False
            self.host.resume(self.tp)


def _offset(event: InboxEvent) -> int:
    return event.offset


def _payload_bytes(events: Sequence[InboxEvent]) -> int:
    return sum(len(v) for e in events if (v := e.record_value) is not None)

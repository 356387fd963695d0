"""The WAL source's events for a Kafka partition that does not answer, or a topic that does
not exist yet, held in memory while the other partitions' events flow.

The table source leaves such rows in the table and claims past them (relay/kafka/partitions.py).
The WAL source reads one stream in commit order; without this, the batches waiting for a
stalled partition or a missing topic would fill their streams and stop the reading for
every key. So the events of a partition Kafka calls unavailable (``PartitionUnavailable``)
leave their batch for a queue of that partition, those of a missing topic
(``TopicMissing``) for a queue of the whole topic (partition ``WHOLE_TOPIC``), and the
batch goes on without them.

Per-key order. A key always maps to one partition, so once a partition has a queue, every
later event of that partition joins it (``route``, before its batch is published), behind
the held ones, until the queue is empty; once a topic has one, every later event of the
topic does. The queue is published in order by a task of its own, one batch at a time,
each retried in place until Kafka acknowledges it (or refuses an event for good: the
failed table, as for any batch). Keyless events carry no order and are
held like the others. The partitions a topic's keys map to are those of the moment its
first event was held, so that a metadata refresh cannot route a later event of a key past
its held ones.

Confirmation. A batch with held events is settled only once they are (``hold`` returns a
future), and the slot's position is confirmed only past settled batches
(relay/sources/wal/source.py): it stays before the oldest held event, and a crash reads it again.

Memory. Held payload bytes count against ``relay.max_inflight_bytes``; past it, the batch
that held more waits for room (``room``), and so the reading does, as before for any stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import Gauge

from outbox.kafka.partitioner import key_partition
from relay.event import KEY, PAYLOAD, TOPIC, Event
from relay.waiting import sleep_unless

log = logging.getLogger("relay.wal")

TopicPartition = tuple[str, int]
# Publish rows until each is acknowledged or moved to the failed table; False when it gave
# up because the relay is stopping (WalSource._settle, retrying in place).
Settle = Callable[[list[Event]], Awaitable[bool]]
# How often a batch waiting for room looks again.
ROOM_POLL_SECONDS = 0.05
# The partition of a queue that holds a whole topic (one that does not exist yet).
WHOLE_TOPIC = -1


class _Queue:
    def __init__(self) -> None:
        self.rows: deque[tuple[Event, asyncio.Future[None]]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.delivered = 0


class HeldPartitions:
    def __init__(
        self,
        settle: Settle,
        limit: int,
        batch_size: int,
        woken: Callable[[], None],
        gauge: Gauge,
    ) -> None:
        self._settle = settle
        self._gauge = gauge  # outbox_relay_wal_held_events
        self._limit = limit
        self._batch_size = batch_size
        self._woken = woken  # the read loop's wake-up: something settled, or failed
        self._queues: dict[TopicPartition, _Queue] = {}
        self._parts: dict[str, list[int]] = {}  # a topic's partitions when first held
        self.bytes = 0
        self._full = False  # past the limit: the reading waits
        self.failure: Exception | None = None

    def __bool__(self) -> bool:
        return bool(self._queues)

    def route(self, row: Event) -> TopicPartition | None:
        """The queue ``row`` must join, if its topic or its partition has one."""
        topic = row[TOPIC]
        if (topic, WHOLE_TOPIC) in self._queues:
            return topic, WHOLE_TOPIC
        key: bytes | None = row[KEY]
        parts = self._parts.get(topic)
        if key is None or parts is None:
            return None
        tp = (topic, key_partition(parts, key))
        return tp if tp in self._queues else None

    def may_hold(self, row: Event, tp: TopicPartition, parts: list[int] | None) -> bool:
        """Whether ``row``, refused because ``tp`` is unavailable, belongs to ``tp`` (rows
        after a refusal in a one-by-one publish are refused for it too, wherever they go:
        those are retried in place). ``parts``: the topic's partitions as planned."""
        if row[KEY] is None:
            return True
        known = self._parts.get(tp[0], parts)
        return known is not None and key_partition(known, row[KEY]) == tp[1]

    def hold(
        self, tp: TopicPartition, rows: Sequence[Event], parts: list[int] | None
    ) -> asyncio.Future[list[None]]:
        """Queue ``rows`` (in order) behind ``tp``'s held events; the future is done once
        every one of them is settled."""
        loop = asyncio.get_running_loop()
        if tp[0] not in self._parts and parts is not None:
            self._parts[tp[0]] = list(parts)
        queue = self._queues.get(tp)
        if queue is None:
            queue = self._queues[tp] = _Queue()
            if tp[1] == WHOLE_TOPIC:  # the publisher said what to do (outbox topics ensure)
                log.info(
                    "events of Kafka topic %s wait in memory until it exists; the slot is "
                    "confirmed up to the first of them",
                    tp[0],
                    extra={"topic": tp[0]},
                )
            else:
                log.warning(
                    "Kafka partition %s[%d] does not answer: its events wait in memory while "
                    "the other partitions' go on; the slot is confirmed up to the first of "
                    "them",
                    *tp,
                    extra={"topic": tp[0], "partition": tp[1]},
                )
        futures = []
        for row in rows:
            future: asyncio.Future[None] = loop.create_future()
            queue.rows.append((row, future))
            futures.append(future)
            self.bytes += len(row[PAYLOAD] or b"")
        self._gauge.inc(len(rows))
        if queue.task is None:
            queue.task = asyncio.ensure_future(self._drain(tp, queue))
        return asyncio.gather(*futures)

    async def room(self, stopping: asyncio.Event) -> None:
        """Until the held events fit in the limit again (or stopping)."""
        if self.bytes <= self._limit:
            return
        if not self._full:  # said once per spell, whichever stream meets it first
            self._full = True
            log.warning(
                "events held for Kafka (unavailable partitions, missing topics) reached "
                "relay.max_inflight_bytes (%d bytes): reading the slot waits for Kafka",
                self.bytes,
            )
        while self.bytes > self._limit and not stopping.is_set() and self.failure is None:
            await sleep_unless(stopping, ROOM_POLL_SECONDS)
        if self._full and self.bytes <= self._limit:
            self._full = False
            log.info("held events fit in relay.max_inflight_bytes again: reading the slot")

    async def _drain(self, tp: TopicPartition, queue: _Queue) -> None:
        try:
            while queue.rows:
                taken = [queue.rows[i] for i in range(min(len(queue.rows), self._batch_size))]
                if not await self._settle([row for row, _ in taken]):
                    return  # stopping: the futures stay pending, nothing is confirmed
                for row, future in taken:
                    queue.rows.popleft()
                    self.bytes -= len(row[PAYLOAD] or b"")
                    future.set_result(None)
                queue.delivered += len(taken)
                self._gauge.dec(len(taken))
                self._woken()
            # No await since the queue was seen empty: a row routed to it now would be
            # left behind, so it goes only while nothing can be added.
            del self._queues[tp]
            if all(topic != tp[0] for topic, _ in self._queues):
                self._parts.pop(tp[0], None)  # a later hold sees the partitions of then
            where = tp[0] if tp[1] == WHOLE_TOPIC else f"{tp[0]}[{tp[1]}]"
            log.info(
                "Kafka %s takes events again: its %d held events are delivered",
                where,
                queue.delivered,
                extra={"topic": tp[0], "partition": tp[1]},
            )
        except Exception as exc:  # cancelling (the reading ends) goes through
            self.failure = exc  # raised by the read loop (check), which it wakes
            self._woken()

    def check(self) -> None:
        """Raise what failed in a held partition's publishing (a database error moving an
        event to the failed table, say), where the reading can handle it."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    async def close(self) -> None:
        """Stop publishing held events (the reading ends; what they held back is not
        confirmed and is read again)."""
        tasks = [q.task for q in self._queues.values() if q.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queue in self._queues.values():
            for _, future in queue.rows:
                future.cancel()
        self._queues.clear()
        self._parts.clear()
        self.bytes = 0
        self._full = False
        self.failure = None  # the reading that would have raised it has ended
        self._gauge.set(0)

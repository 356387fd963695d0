"""Settling the WAL source's batches: publish until every event is acknowledged or moved to
the failed table (committed before the slot may move past it), carrying out the verdict of
relay/verdict.py in place — the event stays where it is, in order, and is tried again —
or, for a partition Kafka does not answer for (or a topic that does not exist yet), handing
it to the held queues (relay/sources/wal/held.py) while the other partitions flow.

When Kafka refuses a whole record batch for one record too large for the topic, the batch
is tried one event at a time from then on, so only that one fails.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from outbox import envelope
from outbox.errors import RecordRejected, TopicMissing
from outbox.settings import RelaySettings
from relay.database import Connection
from relay.errors import PartitionUnavailable
from relay.event import (
    CE_ID,
    EVENT_TYPE,
    KEY,
    PAYLOAD,
    TOPIC,
    Event,
    quarantined,
    storable_event,
    with_identity,
)
from relay.failed import report_moved
from relay.fence import Fence
from relay.kafka.outcome import Outcome
from relay.kafka.publisher import Publisher
from relay.kafka.state import KafkaState
from relay.metrics import RelayMetrics
from relay.sources.wal.held import WHOLE_TOPIC, HeldPartitions
from relay.sources.wal.store import WalStore, lsn_text
from relay.sources.wal.streams import KeyStream, Wake
from relay.store import RelayStore
from relay.verdict import Verdicts
from relay.waiting import sleep_unless

log = logging.getLogger("relay.wal")

# The autocommit connection of the failed table (and of the table check when switching).
SideConnection = Callable[[], Awaitable[Connection]]


class Settler:
    def __init__(
        self,
        settings: RelaySettings,
        lanes: int,
        publisher: Publisher,
        kafka: KafkaState,
        metrics: RelayMetrics,
        verdicts: Verdicts,
        store: WalStore,
        relay_store: RelayStore,
        side: SideConnection,
        wake: Wake,
        fence: Fence,
    ) -> None:
        self._lanes = lanes
        self._publisher = publisher
        self._kafka = kafka
        self._metrics = metrics
        self._verdicts = verdicts
        self._store = store
        self._relay_store = relay_store
        self._side = side
        self._wake = wake
        self._fence = fence  # nothing goes to Kafka once another relay may read the slot
        self._attempts: dict[str, int] = {}  # event id -> refusals so far
        self.stopping = asyncio.Event()  # the relay's, once it runs
        # Events of partitions Kafka does not answer for, while the others flow.
        self.held = HeldPartitions(
            self.settle_in_place,
            settings.max_inflight_bytes,
            settings.batch_size,
            wake.nudge,
            metrics.wal_held,
        )

    async def settle_batch(self, stream: KeyStream, number: int, rows: list[Event]) -> None:
        """Settle the stream's batch ``number``: at once, or, when some of its events are
        held for an unavailable partition, once they are delivered."""
        try:
            held: list[asyncio.Future[Any]] = []
            if not await self._settle(rows, held):
                return
            if not held:
                stream.settle(number)
                return
            await self.held.room(self.stopping)  # held events stay within the memory bound

            def settled(future: asyncio.Future[Any]) -> None:
                if not future.cancelled() and future.exception() is None:
                    stream.settle(number)
                self._wake.nudge()

            asyncio.gather(*held).add_done_callback(settled)
        finally:
            self._wake.nudge()

    async def settle_in_place(self, rows: list[Event], within: float | None = None) -> bool:
        """``rows`` retried in place, in order, until settled (a held partition's events;
        the outbox table's rows, table_rows.py, for at most ``within`` seconds of
        retries); False when stopping or out of time (nothing settled is undone: the
        caller rolls back what it claimed)."""
        return await self._settle(rows, None, within)

    async def _settle(
        self,
        rows: list[Event],
        held: list[asyncio.Future[Any]] | None,
        within: float | None = None,
    ) -> bool:
        """Publish ``rows`` until every event is acknowledged or moved to the failed table
        (committed before the slot can move past it); while stopping it may give up early
        (False: nothing is confirmed then). With ``held`` (a list), events of an unavailable
        partition are held instead (relay/sources/wal/held.py): the futures that say when
        they are settled are added to it."""
        stopping = self.stopping
        loop = asyncio.get_running_loop()
        deadline = None if within is None else loop.time() + within
        todo = list(range(len(rows)))
        if held is not None and self.held:
            # A held partition's later events queue behind it (per-key order).
            routed: dict[tuple[str, int], list[Event]] = {}
            direct = []
            for i in todo:
                tp = self.held.route(rows[i])
                if tp is None:
                    direct.append(i)
                else:
                    routed.setdefault(tp, []).append(rows[i])
            held.extend(self.held.hold(tp, queued, None) for tp, queued in routed.items())
            todo = direct
        alone = False
        while todo:
            if stopping.is_set():
                return False
            sent = [rows[i] for i in todo]
            failed = await self._send(sent, alone)
            # Kafka refuses a whole record batch for one record too large for the topic:
            # a refusal in a batch of several charges no attempt, the events go again one
            # by one and only the one refused alone is charged (with max_attempts 1, the
            # others would otherwise go to the failed table with it).
            batch = not alone and len(sent) > 1
            retry: list[int] = []
            dead: list[tuple[Event, int, str]] = []
            to_hold: dict[tuple[str, int], list[Event]] = {}
            delay = 0.0
            for j, exc in sorted(failed.items()):
                row = sent[j]
                if held is not None:
                    tp = self._to_hold(row, exc)
                    if tp is not None:
                        to_hold.setdefault(tp, []).append(row)
                        continue
                verdict = self._verdicts.of(exc, row[TOPIC], self._attempts.get(row[CE_ID], 0))
                if verdict.refused:
                    alone = True
                    if batch:
                        retry.append(todo[j])
                        continue
                    self._attempts[row[CE_ID]] = verdict.attempts
                if verdict.failed:
                    dead.append((row, verdict.attempts, str(exc)))
                    continue
                wait = self._kafka.backoff() if verdict.kafka_down else verdict.delay
                delay = max(delay, wait)
                retry.append(todo[j])
            if dead:
                await self._move_to_failed(dead)
            if held is not None:
                held.extend(
                    self.held.hold(tp, queued, self._partitions(tp[0]))
                    for tp, queued in to_hold.items()
                )
            todo = retry
            if todo:
                if deadline is not None and loop.time() + delay > deadline:
                    return False
                await sleep_unless(stopping, delay)
        if self._attempts:
            for row in rows:
                self._attempts.pop(row[CE_ID], None)
        return True

    async def _send(self, rows: list[Event], alone: bool) -> dict[int, Exception]:
        """Publish ``rows`` (in one call, or one by one in order); what failed, by index."""
        loop = asyncio.get_running_loop()
        await self._fence.check()
        if not alone:
            started = loop.time()
            outcome = await self._publisher.publish(rows, started)
            self._record(outcome, len(rows), loop.time() - started)
            return outcome.failed
        failed: dict[int, Exception] = {}
        for j, row in enumerate(rows):
            await self._fence.check()
            started = loop.time()
            outcome = await self._publisher.publish([row], started)
            self._record(outcome, 1, loop.time() - started)
            if outcome.failed:
                failed[j] = exc = outcome.failed[0]
                if not isinstance(exc, RecordRejected):
                    # Kafka's trouble, not the record's: nothing after it may go first.
                    failed.update(dict.fromkeys(range(j + 1, len(rows)), exc))
                    break
        return failed

    def _to_hold(self, row: Event, exc: Exception) -> tuple[str, int] | None:
        """The queue ``row`` goes to, refused with ``exc``, if it is held: its partition's
        when Kafka does not answer for it, its topic's when the topic does not exist. (A
        one-by-one publish refuses every row after a refusal with it: those of other
        partitions or topics are retried in place.)"""
        if isinstance(exc, PartitionUnavailable):
            if self.held.may_hold(row, exc.tp, self._partitions(exc.tp[0])):
                return exc.tp
        elif isinstance(exc, TopicMissing) and row[TOPIC] == exc.topic:
            return exc.topic, WHOLE_TOPIC
        return None

    def _partitions(self, topic: str) -> list[int] | None:
        """``topic``'s partitions as the publisher last planned them."""
        return self._publisher.planner.partitions.get(topic)

    def _record(self, outcome: Outcome, rows: int, seconds: float) -> None:
        # Not quiet: a stalled partition's rows wait in place here (the read waits for
        # them), so only a publish that failed as a whole says Kafka is down.
        self._kafka.record(outcome, rows, seconds, self._metrics, quiet=False)

    async def quarantine(self, content: bytes, lsn: int, ce_time: str, reason: str) -> None:
        """An outbox message that does not decode (garbled, truncated, or written by
        something else under the prefix): kept in the failed table, its bytes as the
        payload, committed before the slot may move past it (the reader awaits this before
        it reads on), and the stream goes on. Stopping instead would stop every event
        behind it on every start until someone advanced the slot by hand, losing whatever
        the message carried."""
        at = lsn_text(lsn)
        error = (
            f"undecodable WAL message at LSN {at}: {reason}; its bytes are the payload: "
            "`outbox failed retry` emits them again as they are (once what wrote them is "
            "fixed, or the relay upgraded), `outbox failed purge` discards them"
        )
        await self._insert_failed([(quarantined(content, at, ce_time), 0, error)])
        log.error(
            "undecodable WAL message quarantined in the failed table",
            extra={"lsn": at, "error": reason},
        )
        self._metrics.failed.inc()

    async def _move_to_failed(self, dead: list[tuple[Event, int, str]]) -> None:
        await self._insert_failed(dead)
        report_moved(dead, self._metrics)

    async def _insert_failed(self, dead: list[tuple[Event, int, str]]) -> None:
        """Into the failed table, each with an outbox identity of its own (a new id, its
        lane, its fingerprint), committed before the slot may move past it."""
        conn = await self._side()
        cur = await conn.execute(self._store.new_ids, {"n": len(dead)})
        ids = [int(r[0]) for r in await cur.fetchall()]
        rows, errors = [], []
        for new_id, (row, _, error) in zip(ids, dead, strict=True):
            # A NUL in a decoded event's text would make this INSERT fail on every start
            # (a crash loop with the slot pinned): escaped, and said so in last_error.
            kept, escaped = storable_event(row)
            errors.append(f"{error} (text PostgreSQL cannot store escaped)" if escaped else error)
            rows.append(
                with_identity(
                    kept,
                    new_id,
                    envelope.lane_for(row[KEY], uuid.UUID(row[CE_ID]), self._lanes),
                    envelope.fingerprint(row[TOPIC], row[KEY], row[EVENT_TYPE], row[PAYLOAD]),
                )
            )
        store = self._relay_store
        for params in store.restore_chunks(rows, [d[1] for d in dead], errors, [0.0] * len(dead)):
            await conn.execute(store.move_to_failed, params)

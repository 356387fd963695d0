"""One claim -> publish -> acknowledge loop. A relay runs ``relay.pipelines`` of them, each
on its own connection and its own slice of the owned lanes, so one pipeline claims and
commits while another waits for Kafka acks. Lanes never overlap between pipelines (and the
claim fence would serialize them if they briefly did during a rebalance), so per-lane
order holds.

Per batch, in one transaction: claim (delete or mark) up to ``batch_size`` rows of the
pipeline's lanes — fewer when their payloads pass its share of ``max_inflight_bytes`` —
send them, wait for the acks, put back every row Kafka did not acknowledge, commit. A
lane's next rows are only claimed after that commit, so a batch is fully settled before
its lane moves on; an unacknowledged row keeps its id and is sent again before anything
that follows it.

Wake-ups: adaptive polling, plus a NOTIFY only while a relay sleeps. PostgreSQL
serializes the commits of notifying transactions, and a trigger notifying per transaction
cut producers' commit throughput by more than half (docs/performance/relay.md), so the
relay polls: immediately again after a full batch, after ``min_poll_interval_seconds``
after a partial one, and doubling up to ``poll_interval_seconds`` while the outbox is
empty. A claim that finds nothing takes a wake slot with its COMMIT (outbox/wake.py), and
then the sleep after it ends at the first producer's commit; while no relay holds a slot
producers notify no one. A claim that finds rows gives the slot back when it commits, so a
stream that keeps the relay busy costs producers nothing.

What Kafka did not acknowledge gets the one verdict of relay/verdict.py, carried out in the
claiming transaction: put back (same id, same place in its lane) with its attempts and
delay, or moved to the failed table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from operator import itemgetter
from typing import cast

import psycopg

from outbox.errors import ConfigurationError, RecordRejected, TopicMissing
from outbox.settings import RelaySettings
from relay import tracing
from relay.database import Connection, Database
from relay.errors import PartitionUnavailable
from relay.event import ATTEMPTS, ID, LANE, TOPIC, Event
from relay.failed import report_moved
from relay.fence import Fence
from relay.fence import now as fence_now
from relay.kafka.outcome import Outcome
from relay.kafka.publisher import Publisher
from relay.kafka.state import KafkaState
from relay.metrics import RelayMetrics
from relay.outage import DATABASE_ERRORS, OutageGuard
from relay.sources.table.claimers import Claimers
from relay.sources.table.cursor import ClaimCursors
from relay.sources.table.lanes import LaneManager
from relay.sources.table.store import CLAIM_SESSION_SETTINGS, ClaimStore
from relay.sources.table.wakes import WakePolicy
from relay.verdict import Verdicts
from relay.waiting import drop_notifications, sleep_unless, sleep_unless_notified

log = logging.getLogger("relay.pipeline")

_by_id = itemgetter(ID)
# Poll at the shortest interval for this long after the last rows were claimed.
_STAY_HOT_SECONDS = 1.0


class Pipeline:
    def __init__(
        self,
        index: int,
        settings: RelaySettings,
        database: Database,
        store: ClaimStore,
        lanes: LaneManager,
        publisher: Publisher,
        kafka: KafkaState,
        metrics: RelayMetrics,
        cursors: ClaimCursors,
        claimers: Claimers,
        verdicts: Verdicts,
        guard: OutageGuard,
    ) -> None:
        self._index = index
        self._settings = settings
        self._database = database
        self._store = store
        self._lanes = lanes
        self._publisher = publisher
        self._kafka = kafka
        self._metrics = metrics
        self._cursors = cursors
        self._claimers = claimers
        self._verdicts = verdicts
        self._guard = guard
        self._conn: Connection | None = None
        self._slot: int | None = None  # the wake slot this session holds (outbox/wake.py)
        self._drained_at = -1e9  # loop time the session's notification backlog was dropped
        self._poll_next = False  # rows became due as the slot was taken: the next sleep polls
        self._wakeable: bool | None = None  # the outbox table has the wake-up trigger
        self._rotation = 0
        self._tried_at = -1e9  # loop time this pipeline last claimed (Kafka down: a probe)
        # A claim frozen before its publish is not sent once others may own its lanes.
        self._fence = Fence(settings.takeover_seconds, self._prove, f"pipeline {index}'s claim")

    def _my_lanes(self) -> list[int]:
        mine = self._claimers.lanes(self._index, sorted(self._lanes.owned))
        if not mine:
            return mine
        # Rotate the scan start so that a busy first lane cannot starve the others.
        self._rotation = (self._rotation + 1) % len(mine)
        return mine[self._rotation :] + mine[: self._rotation]

    async def run(self, stopping: asyncio.Event) -> None:
        r = self._settings
        idle = r.min_poll_interval_seconds
        loop = asyncio.get_running_loop()
        last_rows = -_STAY_HOT_SECONDS
        woken = False  # the last sleep was ended by a notification
        wakes = WakePolicy()
        try:
            while not stopping.is_set():
                if not await self._kafka_ready(stopping):
                    continue
                lanes = self._my_lanes()
                if not lanes:
                    if self._lanes.owned:  # a light stream: the first pipeline claims them
                        await self._claimers.wait_busy(r.poll_interval_seconds)
                    else:
                        await self._lanes.wait_changed(r.poll_interval_seconds)
                    continue
                try:
                    if self._conn is None:
                        self._conn = await self._connect()
                    started = loop.time()
                    wakeable = bool(self._wakeable) and wakes.wakeable(loop.time())
                    claimed = await self._batch(lanes, wakeable)
                    self._guard.ok()
                except DATABASE_ERRORS as exc:
                    # By the SQLSTATE table (outbox/dberrors.py): a full disk or a read-only
                    # switch is an outage like a lost connection, never a row's fault.
                    # Whatever the batch held was rolled back by PostgreSQL; rows are pending
                    # again and are re-sent (at-least-once), so nothing is lost.
                    await self._guard.survive(exc, stopping, self._close)
                    continue
                now = loop.time()
                # The short interval runs from the start of one claim to the next: the time
                # a batch spent waiting for acks already counts towards it.
                short = started + r.min_poll_interval_seconds - now
                wakes.claimed(claimed, woken, now)
                woken = False
                if claimed > 0:
                    self._claimers.settled(now - started)
                    last_rows, idle = now, r.min_poll_interval_seconds
                    if claimed < r.batch_size and short > 0:
                        await sleep_unless(stopping, short)
                elif now - last_rows < _STAY_HOT_SECONDS and not self._notified_of_rows():
                    # An empty poll amid a steady stream is a gap between events, not
                    # the end of the stream: backing off here would add the backoff to
                    # the next event's latency (tens of ms at the tail). With a wake slot
                    # the next event ends the sleep itself: backing off costs it nothing
                    # and saves the polls (at 5 events/s, most of a relay's CPU).
                    woken = await self._sleep(stopping, short)
                else:
                    woken = await self._sleep(stopping, idle)
                    idle = min(idle * 2, r.poll_interval_seconds)
        finally:
            await self._close()

    def _notified_of_rows(self) -> bool:
        """Whether a producer's commit will end this session's next sleep."""
        return self._slot is not None and not self._poll_next

    async def _sleep(self, stopping: asyncio.Event, seconds: float) -> bool:
        """Sleep after an empty claim; a producer's commit ends it while this session holds
        a wake slot (then True). Without a slot, notifications meant for other sleeping
        relays pile up in the session's backlog: they are dropped once a second."""
        conn = self._conn
        poll, self._poll_next = self._poll_next, False
        try:
            if self._slot is not None and conn is not None and not poll:
                return await sleep_unless_notified(conn, stopping, seconds)
            now = asyncio.get_running_loop().time()
            if conn is not None and now >= self._drained_at + 1:
                self._drained_at = now
                await drop_notifications(conn)
        except psycopg.Error:
            await self._close()  # the next claim connects again (and reports an outage)
            return False
        await sleep_unless(stopping, seconds)
        return False

    async def _connect(self) -> Connection:
        # Unprepared: the claim is never prepared (see _batch), and preparing BEGIN, COMMIT
        # and the rare restore saves nothing.
        conn = await self._database.connect(f"outbox-relay-{self._index}")
        try:
            await conn.execute(CLAIM_SESSION_SETTINGS)
            await conn.execute(self._store.listen)
            row = await (await conn.execute(self._store.wake_trigger)).fetchone()
        except BaseException:
            await conn.close()
            raise
        wakeable = bool(row and row[0])
        if wakeable != self._wakeable:
            self._wakeable = wakeable
            if not wakeable:
                log.info(
                    "the outbox table has no wake-up trigger (migration 0012): the relay "
                    "polls only, as before it (docs/howto/own-alembic.md)"
                )
        return conn

    async def _prove(self) -> None:
        """A round trip in the claiming transaction: it fails once the session is gone."""
        assert self._conn is not None
        await (await self._conn.execute(b"SELECT 1")).fetchone()

    async def _close(self) -> None:
        # The session's locks, its wake slot among them, end with it.
        conn, self._conn, self._slot = self._conn, None, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    async def _kafka_ready(self, stopping: asyncio.Event) -> bool:
        """Connect the producer and, after an outage, wait (with full jitter) until the
        batches that timed out are acknowledged — they are the probe for recovery — or
        some of their partitions can take rows again (``Publisher.wait_answered``)."""
        try:
            await self._publisher.ensure_started()
        except ConfigurationError:
            raise  # refused for its settings (credentials, TLS, permissions): stop, exit 2
        except Exception as exc:
            self._kafka.failed(exc)
            self._metrics.errors.labels(type(exc).__name__).inc()
            await sleep_unless(stopping, self._kafka.backoff())
            return False
        if self._kafka.up or self._publisher.replaced_at > self._tried_at:
            # Since this pipeline last tried, Kafka moved stalled partitions and their
            # producers were replaced: their rows are worth a try at once.
            return True
        delay = self._kafka.backoff()
        if self._publisher.has_outstanding:
            if not await self._publisher.wait_answered(delay):
                self._kafka.failed(TimeoutError("earlier batches still unanswered"))
                return False
            return True  # Kafka answered an old batch, or took partitions back: try
        # Nothing to wait for — perhaps because the stuck batches' producers were replaced:
        # rows put back for their partitions are worth a try as soon as they are due, not
        # after the backoff (which slept well past them: docs/performance/relay.md).
        await sleep_unless(stopping, self._publisher.release_within(delay))
        return True

    async def _batch(self, lanes: list[int], wakeable: bool = False) -> int:
        """One claim, its publish and its settlement; ``wakeable``: if it finds nothing,
        take a wake slot for the sleep that follows (unless all are taken)."""
        conn = self._conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        started = self._tried_at = loop.time()
        claim_sent = fence_now()  # the fence's clock (the loop's may be uvloop's)
        outcome: Outcome | None = None
        rows: list[Event] = []
        # Where each lane's scan starts (relay/sources/table/cursor.py); with a horizon known, the
        # probe rides in the same round trip and says how far the cursors may move afterwards.
        start = self._cursors.start(lanes)
        first_pending: dict[int, int | None] = {}
        # Pipeline mode: BEGIN travels with the claim and COMMIT with the closing sync, two
        # round trips per batch instead of three. The block is opened and closed by hand
        # because psycopg's transaction() syncs right after BEGIN in a pipeline.
        fresh = [lane for lane in lanes if lane in self._lanes.fresh]
        settled: list[int] = []
        # A statement taking or giving back the wake slot is unanswered: should the batch
        # fail meanwhile, whether the session holds a slot is unknown, and a slot held by
        # mistake would make producers notify for nothing until the session ends.
        unsure = False
        slot = due = None
        try:
            async with conn.pipeline():
                await conn.execute(b"BEGIN")
                if not wakeable and self._slot is not None:
                    # Kept by a batch rolled back on purpose after claiming rows, or by a
                    # pipeline that stopped taking slots for a while.
                    unsure = True
                    await conn.execute(self._store.release_wake_slot, {"slot": self._slot})
                    self._slot = None
                # The fences first, in a statement of their own: the claim's snapshot must be
                # taken with them held (relay/sources/table/store.py, the module docstring).
                await conn.execute(self._store.fence, {"lanes": lanes})
                if fresh:
                    settled = await self._take_over(conn, fresh)
                    lanes = [lane for lane in lanes if lane not in fresh or lane in settled]
                    start = self._cursors.start(lanes)
                cur = conn.cursor(binary=True)
                # Never a cached generic plan: the outbox swings between empty and huge, and
                # a plan made for an empty table (a seq scan per lane) would crawl on a
                # backlog. Planning each claim costs well under a millisecond.
                await cur.execute(
                    self._store.claim,
                    {
                        "lanes": lanes,
                        "after": start.after,
                        "limit": self._settings.batch_size,
                        "max_bytes": self._claimers.claim_bytes,
                    },
                    prepare=False,
                )
                probe = None
                if start.behind:
                    probe = conn.cursor(binary=True)
                    await probe.execute(
                        self._store.probe,
                        {
                            "lanes": [lane for lane, _ in start.behind],
                            "after": [after for _, after in start.behind],
                            "horizon": start.horizon,
                        },
                    )
                rows = cast(list[Event], await cur.fetchall())
                if not rows and wakeable and self._slot is None:
                    # Nothing to claim: a sleep follows, which a producer's commit may end
                    # (outbox/wake.py). The slot, then a look at what became due meanwhile,
                    # in the COMMIT's round trip.
                    slot, due, unsure = conn.cursor(), conn.cursor(), True
                    await slot.execute(self._store.take_wake_slot)
                    await due.execute(self._store.due, {"lanes": lanes, "after": start.after})
                self._claimers.claimed(rows)
                # Drop libpq's copy of the result (as large as the rows) before the
                # producer makes its own.
                await cur.close()
                if probe is not None:
                    first_pending = {int(lane): first for lane, first in await probe.fetchall()}
                if rows:
                    # The claim was the last round trip: if it was sent long ago (a
                    # freeze), the session may have been ended and the lanes taken over.
                    self._fence.answered(claim_sent)
                    await self._fence.check()
                    # Claimed per lane in id order already; one sort makes it explicit and
                    # costs far less than a round trip.
                    rows.sort(key=_by_id)
                    span = tracing.start_send(rows)
                    try:
                        outcome = await self._publisher.publish(rows, started)
                    finally:
                        tracing.end_send(span, outcome)
                    if len(outcome.acked) < len(rows):
                        await self._settle(conn, rows, outcome)
                await conn.execute(b"COMMIT")
                if slot is not None and due is not None:
                    taken, found = await slot.fetchone(), await due.fetchone()
                    self._slot, unsure = (int(taken[0]) if taken else None), False
                    # Rows came meanwhile: poll for them, no wake-up will say so.
                    self._poll_next = bool(found and found[0])
                elif rows and self._slot is not None:
                    # Busy again: no sleep follows, so producers need not notify.
                    unsure = True
                    await conn.execute(self._store.release_wake_slot, {"slot": self._slot})
            self._slot, unsure = (None if rows else self._slot), False
        except BaseException as exc:
            if unsure:
                await self._close()
            else:
                await self._abort(conn)
            if not isinstance(exc, psycopg.Rollback):
                raise
            settled = []  # undone with the rest: taken over again by the next claim
        self._lanes.settle(settled)
        # Committed, or rolled back on purpose: what the probe saw holds either way.
        acked = set(outcome.acked) if outcome is not None else set()
        self._cursors.settle(
            start,
            first_pending,
            [(r[LANE], r[ID]) for i, r in enumerate(rows) if i not in acked],
        )
        if not rows:
            return 0
        self._after(rows, outcome, started, loop.time())
        return len(rows)

    async def _take_over(self, conn: Connection, lanes: list[int]) -> list[int]:
        """Lanes this relay just took over: rows their previous owner put back for an
        unavailable partition or a missing topic become due now, before the first claim, so
        that the claim cannot pass over them and send a later row of their key first (this
        relay knows nothing of the old owner's holds). Under the claim fence, so an old
        owner's batch still in flight finishes first; returns the lanes done (the others
        wait for it)."""
        cur = await conn.execute(
            self._store.release_delays,
            {"lanes": lanes, "held": [PartitionUnavailable.MARKER + "%", TopicMissing.PATTERN]},
        )
        return [int(row[0]) for row in await cur.fetchall()]

    async def _abort(self, conn: Connection) -> None:
        """End a failed batch's transaction; what it claimed is pending again."""
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.execute(b"ROLLBACK")
        except psycopg.Error:
            # Connection unusable: closing it makes PostgreSQL roll the transaction back.
            await self._close()

    async def _settle(self, conn: Connection, rows: list[Event], outcome: Outcome) -> None:
        """Carry out the verdict on what Kafka did not acknowledge; runs inside the claiming
        transaction."""
        failures = outcome.failed.values()
        if (
            outcome.transient is not None
            and not outcome.acked
            and not any(isinstance(exc, RecordRejected | TopicMissing) for exc in failures)
        ):
            # Kafka down as a whole: nothing to keep, nothing to delay (the pipelines back
            # off together); cheapest is to undo the claim.
            raise psycopg.Rollback()
        back: list[tuple[Event, int, str, float]] = []
        dead: list[tuple[Event, int, str]] = []
        for i, exc in outcome.failed.items():
            row = rows[i]
            verdict = self._verdicts.of(exc, row[TOPIC], row[ATTEMPTS])
            if verdict.failed:
                dead.append((row, verdict.attempts, str(exc)))
            else:
                # A missing topic or a sick broker delays the row without an attempt, and
                # the publisher sends no later row of its partition before it (see
                # relay/kafka/partitions.py); Kafka's trouble as a whole puts it back due now.
                back.append((row, verdict.attempts, str(exc), verdict.delay))
        store = self._store
        if back:
            rows_back, attempts, errors, delays = zip(*back, strict=True)
            for params in store.restore_chunks(rows_back, attempts, errors, delays):
                await conn.execute(store.restore, params)
        if dead:
            for params in store.restore_chunks(
                [d[0] for d in dead], [d[1] for d in dead], [d[2] for d in dead], [0.0] * len(dead)
            ):
                await conn.execute(store.move_to_failed, params)
                if store.keep:
                    await conn.execute(store.delete_marked, {"id": params["id"]})
            report_moved(dead, self._metrics)

    def _after(
        self, rows: list[Event], outcome: Outcome | None, started: float, ended: float
    ) -> None:
        """Metrics and Kafka state once the batch's transaction is over."""
        if outcome is None:
            return
        quiet = ended - self._publisher.last_ack >= self._settings.ack_timeout_seconds
        self._kafka.record(outcome, len(rows), ended - started, self._metrics, quiet)

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

Wake-ups: adaptive polling, no NOTIFY. Measured on this machine (bench/relay.py,
PostgreSQL 15, 8 producer clients, one-row transactions): a statement-level AFTER INSERT
trigger calling ``pg_notify`` (one notification per transaction) cut producer commits from
~15.7k/s to ~6.1k/s, because PostgreSQL serializes the commits of notifying transactions.
Producers' commit throughput matters more than the few milliseconds NOTIFY would save, so
the relay polls: immediately again after a full batch, after ``min_poll_interval_seconds``
after a partial one, and doubling up to ``poll_interval_seconds`` while the outbox is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from operator import itemgetter
from typing import Any

import psycopg

from outbox.db import unavailable, unprepared_connection
from outbox.dberrors import is_transient
from outbox.errors import ConfigurationError, DatabaseUnavailable, SchemaMissing, TopicMissing
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay import tracing
from relay.crew import Crew
from relay.cursor import ClaimCursors
from relay.errors import PartitionUnavailable, RecordRejected
from relay.failed import report_moved
from relay.kafka_state import KafkaState
from relay.lanes import LaneManager
from relay.metrics import RelayMetrics
from relay.outcome import Outcome
from relay.publisher import Publisher
from relay.store import (
    ATTEMPTS,
    CLAIM_SESSION_SETTINGS,
    ID,
    LANE,
    TOPIC,
    ClaimedRow,
    RelayStore,
)
from relay.waiting import sleep_unless

log = logging.getLogger("relay.pipeline")

_by_id = itemgetter(ID)
# How long the rows of a topic Kafka does not have wait before the topic is asked for again.
MISSING_TOPIC_RECHECK_SECONDS = 5.0
# Poll at the shortest interval for this long after the last rows were claimed.
_STAY_HOT_SECONDS = 1.0


class Pipeline:
    def __init__(
        self,
        index: int,
        settings: OutboxSettings,
        store: RelayStore,
        lanes: LaneManager,
        publisher: Publisher,
        kafka: KafkaState,
        metrics: RelayMetrics,
        cursors: ClaimCursors,
        crew: Crew,
    ) -> None:
        self._database = lanes.database
        self._crew = crew
        self._cursors = cursors
        self._index = index
        self._settings = settings
        self._store = store
        self._lanes = lanes
        self._publisher = publisher
        self._kafka = kafka
        self._metrics = metrics
        r = settings.relay
        # Row rejections back off with full jitter under relay.max_attempts.
        self._row_retry = RetryPolicy(
            settings.retry.base_seconds, settings.retry.cap_seconds, r.max_attempts
        )
        self._db_retry = RetryPolicy.from_settings(settings.retry)
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._rotation = 0
        self._tried_at = -1e9  # loop time this pipeline last claimed (Kafka down: a probe)

    def _my_lanes(self) -> list[int]:
        mine = self._crew.lanes(self._index, sorted(self._lanes.owned))
        if not mine:
            return mine
        # Rotate the scan start so that a busy first lane cannot starve the others.
        self._rotation = (self._rotation + 1) % len(mine)
        return mine[self._rotation :] + mine[: self._rotation]

    async def run(self, stopping: asyncio.Event) -> None:
        r = self._settings.relay
        idle = r.min_poll_interval_seconds
        loop = asyncio.get_running_loop()
        last_rows = -_STAY_HOT_SECONDS
        db_failures = 0
        try:
            while not stopping.is_set():
                if not await self._kafka_ready(stopping):
                    continue
                lanes = self._my_lanes()
                if not lanes:
                    if self._lanes.owned:  # a light stream: the first pipeline claims them
                        await self._crew.wait_busy(r.poll_interval_seconds)
                    else:
                        await self._lanes.wait_changed(r.poll_interval_seconds)
                    continue
                try:
                    if self._conn is None:
                        self._conn = await self._connect()
                    started = loop.time()
                    claimed = await self._batch(lanes)
                    db_failures = 0
                    self._database.ok()
                except psycopg.errors.UndefinedTable as exc:
                    raise SchemaMissing(
                        f"relay table missing ({exc.diag.message_primary})"
                    ) from None
                except (psycopg.Error, DatabaseUnavailable) as exc:
                    # By the SQLSTATE table (outbox/dberrors.py): a full disk or a read-only
                    # switch is an outage like a lost connection, never a row's fault.
                    if not is_transient(exc):
                        raise
                    # Whatever the batch held was rolled back by PostgreSQL; rows are pending
                    # again and are re-sent (at-least-once), so nothing is lost.
                    self._database.failed(unavailable(exc))
                    self._metrics.errors.labels(type(exc).__name__).inc()
                    await self._close()
                    await sleep_unless(stopping, self._db_retry.backoff(db_failures))
                    db_failures += 1
                    continue
                now = loop.time()
                # The short interval runs from the start of one claim to the next: the time
                # a batch spent waiting for acks already counts towards it.
                short = started + r.min_poll_interval_seconds - now
                if claimed > 0:
                    self._crew.settled(now - started)
                    last_rows, idle = now, r.min_poll_interval_seconds
                    if claimed < r.batch_size and short > 0:
                        await sleep_unless(stopping, short)
                elif now - last_rows < _STAY_HOT_SECONDS:
                    # An empty poll amid a steady stream is a gap between events, not
                    # the end of the stream: backing off here would add the backoff to
                    # the next event's latency (tens of ms at the tail).
                    if short > 0:
                        await sleep_unless(stopping, short)
                else:
                    await sleep_unless(stopping, idle)
                    idle = min(idle * 2, r.poll_interval_seconds)
        finally:
            await self._close()

    async def _connect(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        # Unprepared: the claim is never prepared (see _batch), and preparing BEGIN, COMMIT
        # and the rare restore saves nothing.
        conn = await unprepared_connection(self._settings, f"outbox-relay-{self._index}")
        try:
            await conn.execute(CLAIM_SESSION_SETTINGS)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
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
        # after the backoff (it slept 1.6 s past them in a crash run).
        await sleep_unless(stopping, self._publisher.release_within(delay))
        return True

    async def _batch(self, lanes: list[int]) -> int:
        conn = self._conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        started = self._tried_at = loop.time()
        outcome: Outcome | None = None
        rows: list[ClaimedRow] = []
        # Where each lane's scan starts (relay/cursor.py); with a horizon known, the probe
        # rides in the same round trip and says how far the cursors may move afterwards.
        plan = self._cursors.plan(lanes)
        first_pending: dict[int, int | None] = {}
        # Pipeline mode: BEGIN travels with the claim and COMMIT with the closing sync, two
        # round trips per batch instead of three. The block is opened and closed by hand
        # because psycopg's transaction() syncs right after BEGIN in a pipeline.
        fresh = [lane for lane in lanes if lane in self._lanes.fresh]
        settled: list[int] = []
        try:
            async with conn.pipeline():
                await conn.execute(b"BEGIN")
                # The fences first, in a statement of their own: the claim's snapshot must be
                # taken with them held (relay/store.py, the module docstring).
                await conn.execute(self._store.fence, {"lanes": lanes})
                if fresh:
                    settled = await self._take_over(conn, fresh)
                    lanes = [lane for lane in lanes if lane not in fresh or lane in settled]
                    plan = self._cursors.plan(lanes)
                cur = conn.cursor(binary=True)
                # Never a cached generic plan: the outbox swings between empty and huge, and
                # a plan made for an empty table (a seq scan per lane) would crawl on a
                # backlog. Planning each claim costs well under a millisecond.
                await cur.execute(
                    self._store.claim,
                    {
                        "lanes": lanes,
                        "after": plan.after,
                        "limit": self._settings.relay.batch_size,
                        "max_bytes": self._crew.claim_bytes,
                    },
                    prepare=False,
                )
                probe = None
                if plan.behind:
                    probe = conn.cursor(binary=True)
                    await probe.execute(
                        self._store.probe,
                        {
                            "lanes": [lane for lane, _ in plan.behind],
                            "after": [after for _, after in plan.behind],
                            "horizon": plan.horizon,
                        },
                    )
                rows = await cur.fetchall()
                self._crew.claimed(rows)
                # Drop libpq's copy of the result (as large as the rows) before the
                # producer makes its own.
                await cur.close()
                if probe is not None:
                    first_pending = {int(lane): first for lane, first in await probe.fetchall()}
                if rows:
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
        except BaseException as exc:
            await self._abort(conn)
            if not isinstance(exc, psycopg.Rollback):
                raise
            settled = []  # undone with the rest: taken over again by the next claim
        self._lanes.settle(settled)
        # Committed, or rolled back on purpose: what the probe saw holds either way.
        acked = set(outcome.acked) if outcome is not None else set()
        self._cursors.settle(
            plan,
            first_pending,
            [(r[LANE], r[ID]) for i, r in enumerate(rows) if i not in acked],
        )
        if not rows:
            return 0
        self._after(rows, outcome, started, loop.time())
        return len(rows)

    async def _take_over(
        self, conn: psycopg.AsyncConnection[tuple[Any, ...]], lanes: list[int]
    ) -> list[int]:
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

    async def _abort(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        """End a failed batch's transaction; what it claimed is pending again."""
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.execute(b"ROLLBACK")
        except psycopg.Error:
            # Connection unusable: closing it makes PostgreSQL roll the transaction back.
            await self._close()

    async def _settle(
        self,
        conn: psycopg.AsyncConnection[tuple[Any, ...]],
        rows: list[ClaimedRow],
        outcome: Outcome,
    ) -> None:
        """Put back what Kafka did not acknowledge; runs inside the claiming transaction."""
        rejected = {i for i, exc in outcome.failed.items() if isinstance(exc, RecordRejected)}
        missing = {i for i, exc in outcome.failed.items() if isinstance(exc, TopicMissing)}
        if outcome.transient is not None and not outcome.acked and not rejected and not missing:
            # Kafka down as a whole: nothing to keep, nothing to delay (the pipelines back
            # off together); cheapest is to undo the claim.
            raise psycopg.Rollback()
        back: list[tuple[ClaimedRow, int, str, float]] = []
        dead: list[tuple[ClaimedRow, int, str]] = []
        for i, exc in outcome.failed.items():
            row = rows[i]
            if i in missing:
                # A missing topic is a deployment state, not the row's fault: no attempt is
                # counted (nothing moves to failed); the row waits and the topic is asked
                # for again (the publisher logs once per topic), and no later row of it
                # goes out before this one (see relay.partitions).
                self._publisher.topic_missing(row[TOPIC], MISSING_TOPIC_RECHECK_SECONDS)
                back.append((row, row[ATTEMPTS], str(exc), MISSING_TOPIC_RECHECK_SECONDS))
            elif isinstance(exc, PartitionUnavailable):
                # A sick broker: no attempt counted; due again once the delay (which keeps
                # claims from re-reading these rows in a loop) has passed. The publisher
                # sends no later row of the partition before that (see relay.partitions).
                back.append((row, row[ATTEMPTS], str(exc), exc.delay))
            elif i in rejected:
                attempts = row[ATTEMPTS] + 1
                if attempts >= self._row_retry.max_attempts:
                    dead.append((row, attempts, str(exc)))
                else:
                    back.append((row, attempts, str(exc), self._row_retry.backoff(attempts)))
            else:
                # Not the row's fault (broker down, producer reset): no attempt counted.
                back.append((row, row[ATTEMPTS], str(exc), 0.0))
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
        self, rows: list[ClaimedRow], outcome: Outcome | None, started: float, ended: float
    ) -> None:
        """Metrics and Kafka state once the batch's transaction is over."""
        if outcome is None:
            return
        quiet = ended - self._publisher.last_ack >= self._settings.relay.ack_timeout_seconds
        self._kafka.record(outcome, len(rows), ended - started, self._metrics, quiet)

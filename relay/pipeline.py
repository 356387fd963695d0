"""One claim -> publish -> acknowledge loop. A relay runs ``relay.pipelines`` of them, each
on its own connection and its own slice of the owned lanes, so one pipeline claims and
commits while another waits for Kafka acks. Lanes never overlap between pipelines (and the
claim fence would serialize them if they briefly did during a rebalance), so per-lane
order holds.

Per batch, in one transaction: claim (delete or mark) up to ``batch_size`` rows of the
pipeline's lanes, send them, wait for the acks, put back every row Kafka did not
acknowledge, commit. A lane's next rows are only claimed after that commit, so a batch is
fully settled before its lane moves on; an unacknowledged row keeps its id and is sent
again before anything that follows it.

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

from outbox.db import unavailable
from outbox.errors import ConfigurationError, DatabaseUnavailable, SchemaMissing, TopicMissing
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay import tracing
from relay.errors import ProducerBroken, RecordRejected
from relay.kafka_state import KafkaState
from relay.lanes import LaneManager
from relay.metrics import RelayMetrics
from relay.publisher import Outcome, Publisher
from relay.store import (
    ATTEMPTS,
    CE_ID,
    CLAIM_SESSION_SETTINGS,
    ID,
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
    ) -> None:
        self._database = lanes.database
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

    def _my_lanes(self) -> list[int]:
        owned = sorted(self._lanes.owned)
        mine = owned[self._index :: self._settings.relay.pipelines]
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
                    await self._lanes.wait_changed(r.poll_interval_seconds)
                    continue
                try:
                    if self._conn is None:
                        self._conn = await self._connect()
                    started = loop.time()
                    claimed = await self._batch(lanes)
                    db_failures = 0
                    self._database.ok()
                except (
                    psycopg.OperationalError,
                    psycopg.InterfaceError,
                    DatabaseUnavailable,
                ) as exc:
                    # Whatever the batch held was rolled back by PostgreSQL; rows are pending
                    # again and are re-sent (at-least-once), so nothing is lost.
                    self._database.failed(unavailable(exc))
                    self._metrics.errors.labels(type(exc).__name__).inc()
                    await self._close()
                    await sleep_unless(stopping, self._db_retry.backoff(db_failures))
                    db_failures += 1
                    continue
                except psycopg.errors.UndefinedTable as exc:
                    raise SchemaMissing(
                        f"relay table missing ({exc.diag.message_primary})"
                    ) from None
                now = loop.time()
                # The short interval runs from the start of one claim to the next: the time
                # a batch spent waiting for acks already counts towards it.
                short = started + r.min_poll_interval_seconds - now
                if claimed > 0:
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
        try:
            # No server-side prepared statements: the claim is never prepared (see
            # _batch), and preparing BEGIN, COMMIT and the rare restore saves nothing,
            # while behind a pooler that slipped past the lanes' probe a prepared
            # statement fails on the next server session with a misleading error.
            conn = await psycopg.AsyncConnection.connect(
                self._settings.libpq_dsn,
                autocommit=True,
                prepare_threshold=None,
                application_name=f"outbox-relay-{self._index}",
            )
        except psycopg.Error as exc:
            raise unavailable(exc) from None
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
        batches that timed out are acknowledged — they are the probe for recovery."""
        try:
            await self._publisher.ensure_started()
        except ConfigurationError:
            raise  # refused for its settings (credentials, TLS, permissions): stop, exit 2
        except Exception as exc:
            self._kafka.failed(exc)
            self._metrics.errors.labels(type(exc).__name__).inc()
            await sleep_unless(stopping, self._kafka.backoff())
            return False
        if self._kafka.up:
            return True
        delay = self._kafka.backoff()
        if self._publisher.has_outstanding:
            if not await self._publisher.wait_drained(delay):
                self._kafka.failed(TimeoutError("earlier batches still unacknowledged"))
                return False
            return True  # Kafka acknowledged the old batches: try a real one
        await sleep_unless(stopping, delay)
        return True

    async def _batch(self, lanes: list[int]) -> int:
        conn = self._conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        generation = self._publisher.generation
        outcome: Outcome | None = None
        rows: list[ClaimedRow] = []
        # Pipeline mode: BEGIN travels with the claim and COMMIT with the closing sync, two
        # round trips per batch instead of three. The block is opened and closed by hand
        # because psycopg's transaction() syncs right after BEGIN in a pipeline.
        try:
            async with conn.pipeline():
                await conn.execute(b"BEGIN")
                cur = conn.cursor(binary=True)
                # Never a cached generic plan: the outbox swings between empty and huge, and
                # a plan made for an empty table (a seq scan per lane) would crawl on a
                # backlog. Planning each claim costs well under a millisecond.
                await cur.execute(
                    self._store.claim,
                    {"lanes": lanes, "limit": self._settings.relay.batch_size},
                    prepare=False,
                )
                rows = await cur.fetchall()
                if rows:
                    # Claimed per lane in id order already; one sort makes it explicit and
                    # costs far less than a round trip.
                    rows.sort(key=_by_id)
                    span = tracing.start_send(rows)
                    try:
                        outcome = await self._publisher.publish(rows)
                    finally:
                        tracing.end_send(span, outcome)
                    if len(outcome.acked) < len(rows):
                        await self._settle(conn, rows, outcome)
                await conn.execute(b"COMMIT")
        except BaseException as exc:
            await self._abort(conn)
            if not isinstance(exc, psycopg.Rollback):
                raise
        if not rows:
            return 0
        await self._after(rows, outcome, generation, started, loop.time())
        return len(rows)

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
        if not outcome.acked and not rejected and not missing:
            raise psycopg.Rollback()  # nothing to keep: cheapest is to undo the claim
        back: list[tuple[ClaimedRow, int, str, float]] = []
        dead: list[tuple[ClaimedRow, int, str]] = []
        for i, exc in outcome.failed.items():
            row = rows[i]
            if i in missing:
                # A missing topic is a deployment state, not the row's fault: no attempt is
                # counted (nothing moves to failed); the row waits and the topic is asked
                # for again (the publisher logs once per topic).
                self._publisher.forget_topic(row[TOPIC])
                back.append((row, row[ATTEMPTS], str(exc), MISSING_TOPIC_RECHECK_SECONDS))
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
            await conn.execute(
                store.restore,
                store.restore_params(
                    [b[0] for b in back],
                    [b[1] for b in back],
                    [b[2] for b in back],
                    [b[3] for b in back],
                ),
            )
        if dead:
            params = store.restore_params(
                [d[0] for d in dead], [d[1] for d in dead], [d[2] for d in dead], [0.0] * len(dead)
            )
            await conn.execute(store.move_to_failed, params)
            if store.keep:
                await conn.execute(store.delete_marked, {"id": params["id"]})
            for row, attempts, err in dead:
                log.error(
                    "event moved to failed after %d attempts",
                    attempts,
                    extra={"event_id": row[CE_ID], "topic": row[TOPIC], "error": err},
                )
            self._metrics.failed.inc(len(dead))

    async def _after(
        self,
        rows: list[ClaimedRow],
        outcome: Outcome | None,
        generation: int,
        started: float,
        ended: float,
    ) -> None:
        """Metrics and Kafka state once the batch's transaction is over."""
        if outcome is None:
            return
        m = self._metrics
        m.batch_size.observe(len(rows))
        m.batch_seconds.observe(ended - started)
        m.published.inc(len(outcome.acked))
        for exc in outcome.failed.values():
            m.errors.labels(type(exc).__name__).inc()
        transient = outcome.transient
        if transient is None:
            if outcome.acked:
                self._kafka.ok()
            return
        self._kafka.failed(transient)
        if isinstance(transient, ProducerBroken):
            await self._publisher.reset(generation)

"""The consumer daemon: fetch, hand each partition's batch to its processor, commit offsets.

Each assigned partition gets a lane: its fetched records, handled in offset order. Short
runs (all a partition has, up to a transaction's worth) go to the *sharer*, one task that
handles every lane's short run in one shared transaction (see ``inbox/together.py``): at
low rates the per-transaction cost is paid once for the records of many partitions, and
no partition's task is even woken. What cannot share (a backlog longer than a
transaction, a failure to resume from, a marker to read first) runs in the lane's own
task; lanes run concurrently (up to ``max_concurrent_partitions``, taking turns one
transaction at a time when more wait), and a lane far behind pauses its partition's
fetching (the lane: ``inbox/lane.py``). The sharer takes no slot: partitions that are
caught up are never held back by those behind (after a broker's failover, say). Offsets are
committed only after the database commit that finished them, never by auto-commit, by a
committer task that coalesces them so handlers never wait for a Kafka round trip
(``inbox/offsets.py``). On
revocation a revoked partition's in-flight run finishes (a retry backing off is abandoned
before its next attempt) and its offsets are committed before the rebalance proceeds; the
new owner starts at the committed offset and the inbox dedupes the rest.

Lag (``outbox_inbox_lag_records``): inbox/lag.py, refreshed once a second from what the
fetches already brought back; a paused partition's end offset is asked for with the
periodic Kafka check.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from inbox.app import Consumer
from inbox.connections import Connections
from inbox.event import InboxEvent
from inbox.failures import infrastructure_cause, is_infrastructure
from inbox.kafka import KafkaSink, dlq_producer, start_dlq_producer
from inbox.lag import ConsumerLag
from inbox.lane import Lane, LaneHost, Slots
from inbox.linger import FetchLinger
from inbox.marker import AHEAD
from inbox.membership import (
    Membership,
    is_fenced,
    register_fenced_error,
    session_refused,
    static_options,
)
from inbox.metrics import Metrics
from inbox.offsets import OffsetCommitter
from inbox.processor import PartitionProcessor
from inbox.startup import database_ready, topics_ready
from inbox.stats import StatsWriter
from inbox.store import InboxStore
from inbox.together import process_together
from outbox.db import async_engine
from outbox.errors import GroupError, OutboxError
from outbox.kafka import aiokafka_internals
from outbox.kafka.aiokafka_consumer import AioConsumer
from outbox.kafka.client import Consumer as GroupConsumer
from outbox.kafka.client import Partition
from outbox.kafka.clients import kafka_consumer, start_kafka, with_client_options
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from outbox.status_line import StatusLine
from outbox.tables import build_tables

log = logging.getLogger("outbox.inbox")
# /healthz says 503 when fetched records have waited this long without any partition
# committing: stuck (the database down, a handler hanging), not merely idle. Long enough
# for a retry's backoff, so a flaky handler does not get the process restarted.
STALLED_AFTER_SECONDS = 120.0
KAFKA_CHECK_SECONDS = 1.0
LAG_EVERY_SECONDS = 1.0
# At stop, Kafka gets this long for the last offset commit and again for closing the
# consumer (its LeaveGroup, unless static). aiokafka retries a commit a group coordinator
# does not answer (a request timeout, a coordinator lookup, again): that held the exit for
# 37 s. Nothing needs either step: whoever reads the partitions next starts from the last
# committed offset and the inbox skips what was applied; the group moves a member's
# partitions once it has been silent for the session timeout.
KAFKA_AT_STOP_SECONDS = 3.0
# While some partitions are behind, the longest run a caught-up partition brings to the
# shared transaction (a marker armed ahead covers as many: inbox/marker.py AHEAD).
SHORT_RUN = AHEAD


@dataclass
class ConsumerDaemon:
    app: Consumer
    settings: OutboxSettings
    metrics: Metrics | None = None
    _engine: AsyncEngine | None = field(default=None, init=False)
    _kafka: GroupConsumer | None = field(default=None, init=False)
    _lanes: dict[Partition, Lane] = field(default_factory=dict, init=False)
    # Lanes with records for the sharer to look at, in the order they came (a process with
    # many quiet partitions does not pay for each of them).
    _offered: dict[Partition, Lane] = field(default_factory=dict, init=False)
    _offers: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _failure: BaseException | None = field(default=None, init=False)
    _running: bool = field(default=False, init=False)
    _progress_at: float = field(default_factory=time.monotonic, init=False)
    _watcher: asyncio.Task[None] | None = field(default=None, init=False)
    _sharer: asyncio.Task[None] | None = field(default=None, init=False)
    _stats: asyncio.Task[None] | None = field(default=None, init=False)  # inbox/stats.py
    # Static membership (inbox/membership.py): set when an instance id is.
    _membership: Membership | None = field(default=None, init=False)
    _session_timeout_ms: int = field(default=10_000, init=False)  # aiokafka's default

    def __post_init__(self) -> None:
        self.settings = self.settings.for_consumer()  # its own URL, when one is set
        if self.metrics is None:
            self.metrics = Metrics(self.app.name)
        self._lag = ConsumerLag(self.metrics)
        config = self.settings.consumer
        # Backoff only: attempts are counted against consumer.max_attempts per handler.
        self._policy = RetryPolicy(
            self.settings.retry.base_seconds, self.settings.retry.cap_seconds
        )
        self._slots = Slots(config.max_concurrent_partitions)
        self._store = InboxStore(build_tables(self.settings))
        # Shared by every partition: one log line per outage, not one per partition and try.
        self.database = Dependency("database", log)
        self._server: str | None = None  # host:port (primary|standby) the probe reached
        self.kafka = Dependency("Kafka", log)
        self._offsets = OffsetCommitter(self.kafka, self._policy, config.offset_commit_interval_ms)
        # All a lane may use of this daemon (inbox/lane.py).
        self._host = LaneHost(
            config=config,
            slots=self._slots,
            policy=self._policy,
            database=self.database,
            kafka=self.kafka,
            offer=self._offer,
            finished=self._offset_done,
            pause=self._pause,
            resume=self._resume,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; then finish in-flight batches, commit, leave."""
        config = self.settings.consumer
        aiokafka_internals.check()  # one WARNING if this aiokafka lost a capability the inbox uses
        # Before joining the group: a member that cannot process would take partitions
        # from healthy ones. Configuration errors end the run here (exit 2).
        ready = await database_ready(self.settings, self.database, self._policy, stop)
        if ready is None:
            return
        self.settings, self._server = ready.settings, ready.server
        # The app's own Kafka options (TLS, SASL, tuning) reach the admin client and the
        # dead-letter producer too, not only the consumer.
        settings = with_client_options(self.settings, self.app.kafka_options)
        if not await topics_ready(
            self.settings, settings, self.app, self.kafka, self._policy, stop
        ):
            return
        register_fenced_error()
        options: dict[str, Any] = {
            "auto_offset_reset": "earliest",
            "max_poll_records": config.max_batch_records,
            **static_options(self.settings, self.app.kafka_options),
            **self.app.kafka_options,
        }
        # As the consumer will have it (OUTBOX_KAFKA__OPTIONS reach it through _build).
        self._session_timeout_ms = options.get(
            "session_timeout_ms", settings.kafka.options.get("session_timeout_ms", 10_000)
        )
        # Kafka through the client interface of outbox/kafka/client.py (aiokafka behind it).
        kafka = AioConsumer(
            kafka_consumer(settings, group_id=self.app.name, enable_auto_commit=False, **options),
            settings,
        )
        # Two pools. Runs and shared transactions start on connections of the autocommit
        # one, kept open between transactions (inbox/connections.py), where the claim opens
        # the transaction itself (BEGIN rides in its round trip) and attempt markers commit
        # alone; the paths that begin with other statements (savepoints, retries alone,
        # dead letters) use the ordinary one. Separate pools, because switching a pooled
        # connection's mode costs CPU on every checkout.
        #
        # No pre-ping: it costs a round trip per transaction. A connection that died fails
        # the run's first statement instead; that is an infrastructure error (the run is
        # retried, no attempt charged) and the connection is replaced.
        pool = {"pool_size": config.max_concurrent_partitions + 2, "max_overflow": 4}
        self._engine = async_engine(self.settings, pool_pre_ping=False, **pool)
        self._autocommit = async_engine(
            self.settings, pool_pre_ping=False, isolation_level="AUTOCOMMIT", **pool
        )
        self._connections = Connections(self._autocommit)
        sessions = async_sessionmaker(self._engine, expire_on_commit=False)
        producer = dlq_producer(settings)
        # The sink replaces a producer a refused dead letter left unusable (and stops it).
        sink = KafkaSink(producer, renew=lambda: start_dlq_producer(settings))
        self._kafka = self._offsets.consumer = kafka
        try:
            await start_kafka(producer, settings)
            await kafka.start()
            if (instance_id := options.get("group_instance_id")) is not None:
                heartbeat = options.get("heartbeat_interval_ms")
                heartbeat = heartbeat or settings.kafka.options.get("heartbeat_interval_ms", 3000)
                self._membership = Membership(kafka, self.app.name, instance_id, heartbeat)
            kafka.subscribe(self.app.topics, self._on_assigned, self.release)
            self._watcher = asyncio.create_task(self._watch_kafka(kafka))
            self._watcher.add_done_callback(self._watch)
            if config.stats_seconds > 0:
                assert self.metrics is not None
                stats = StatsWriter(self.app.name, self.metrics, self._store, self._engine)
                self._stats = asyncio.create_task(stats.run(config.stats_seconds))
            self._running = True
            log.info(
                "consumer started",
                extra={
                    "consumer": self.app.name,
                    "topics": list(self.app.topics),
                    "group_instance_id": options.get("group_instance_id"),
                    "server": self._server,
                },
            )
            await self._loop(stop, sessions, sink, self._linger(kafka))
        finally:
            self._running = False
            if self._watcher is not None:
                self._watcher.cancel()
            # Each step runs even when one before it failed (an exit stack runs them last
            # registered first): a stopping consumer leaks no producer, connection or pool.
            async with contextlib.AsyncExitStack() as closing:
                closing.push_async_callback(self._autocommit.dispose)
                closing.push_async_callback(self._engine.dispose)
                closing.push_async_callback(self._connections.close)
                closing.push_async_callback(sink.stop)
                # Leaves the group: partitions move. A static member stays in it (no
                # LeaveGroup): its partitions wait for the same instance id to return.
                closing.push_async_callback(
                    _at_stop,
                    kafka.stop,
                    "closing the consumer (its LeaveGroup)",
                    "the group moves this member's partitions after the session timeout",
                )
                if self._sharer is not None:
                    closing.callback(self._sharer.cancel)
                # After the release (its last commits are counted), before the pools close.
                closing.push_async_callback(self._stop_stats)
                closing.push_async_callback(
                    functools.partial(self.release, list(self._lanes), stopping=True)
                )
            log.info("consumer stopped", extra={"consumer": self.app.name, **self._counts()})
        if self._failure is not None:
            raise self._failure

    async def _stop_stats(self) -> None:
        """Cancel the stats writer: it writes what it has counted since, once more."""
        if self._stats is not None:
            self._stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats

    def dependency_of(self, exc: BaseException) -> Dependency:
        """Which service a transient error is about (the DLQ producer's are Kafka's)."""
        return self._host.dependency_of(exc)

    def healthy(self) -> bool:
        """What ``/healthz`` reports: running, no background task failed, and not stalled
        (records waiting while nothing committed for ``STALLED_AFTER_SECONDS``). A member
        with no partitions (more members than partitions) is idle, not unhealthy."""
        waiting = any(lane.events for lane in self._lanes.values())
        stalled = waiting and time.monotonic() - self._progress_at > STALLED_AFTER_SECONDS
        return self._running and self._failure is None and not stalled

    def _counts(self) -> dict[str, int]:
        assert self.metrics is not None
        return {
            **self.metrics.counts,
            "database_retries": self.database.tries,
            "kafka_retries": self.kafka.tries,
        }

    async def _watch_kafka(self, kafka: GroupConsumer) -> None:
        """Ask for metadata every second: the fetch loop does not see an outage (aiokafka
        retries inside ``getmany``), this turns it into one line down, one line up; and it
        keeps the view of who leads each partition fresh when a broker hangs, so that the
        partitions Kafka moves away from it are fetched from their new leaders at once."""
        # aiokafka exposes no public "is the cluster reachable?" (outbox/kafka/metadata_watch.py)
        watch = kafka.metadata_watch(self.app.topics, KAFKA_CHECK_SECONDS)
        ends: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(KAFKA_CHECK_SECONDS)
                if await watch.refresh():
                    self.kafka.ok()
                    # At its own pace: a ListOffsets stuck on a hung broker must not hold up
                    # the metadata refresh that moves fetches away from it.
                    if ends is None or ends.done():
                        ends = asyncio.create_task(self._lag.paused_end_offsets(kafka, self._lanes))
                else:
                    self.kafka.failed("metadata request failed")
        finally:
            if ends is not None:
                ends.cancel()

    def _linger(self, kafka: GroupConsumer) -> FetchLinger:
        """The fetch linger (inbox/linger.py), unless the app tunes fetching itself."""
        tuned = {"fetch_min_bytes", "fetch_max_wait_ms"} & set(self.app.kafka_options)
        linger = 0 if tuned else self.settings.consumer.linger_ms
        return FetchLinger(kafka, linger)

    async def _loop(
        self,
        stop: asyncio.Event,
        sessions: async_sessionmaker[AsyncSession],
        sink: KafkaSink,
        linger: FetchLinger,
    ) -> None:
        assert self._kafka is not None
        config = self.settings.consumer
        committer = asyncio.create_task(self._offsets.run())
        committer.add_done_callback(self._watch)
        # Cancelled only after the lanes are released (run()), so that a shared
        # transaction in flight finishes.
        self._sharer = asyncio.create_task(self._share())
        self._sharer.add_done_callback(self._watch)
        status = StatusLine(
            log,
            "consumer status",
            self.settings.status,
            start=self._counts(),
            fields={"consumer": self.app.name},
        )
        next_status = time.monotonic() + status.interval
        next_lag = time.monotonic()
        rest = config.disarm_idle_seconds
        next_sweep = time.monotonic() + rest / 2
        try:
            while not stop.is_set() and self._failure is None:
                try:
                    batches = await self._kafka.fetch(
                        timeout_ms=config.fetch_timeout_ms,
                        max_records=config.max_batch_records * 4,
                    )
                except GroupError as exc:
                    if self._membership is not None and self._membership.survives(exc):
                        continue  # fenced by a newcomer with this instance id: join again
                    refusal = self._group_refusal(exc)
                    if refusal is None:
                        raise
                    raise refusal from exc  # the broker's error name stays the cause
                linger.fetched(bool(batches))
                if batches:
                    self.kafka.ok()  # records arrived: Kafka is back (if it was gone)
                for tp, records in batches.items():
                    if records:
                        self._offsets.started(tp, records[0].offset)
                        self._lane(tp, sessions, sink).feed(records)
                now = time.monotonic()
                if now >= next_lag:
                    next_lag = now + LAG_EVERY_SECONDS
                    await self._lag.update(self._kafka, self._offsets.committed)
                if rest and now >= next_sweep:
                    next_sweep = now + rest / 2
                    for lane in self._lanes.values():
                        lane.sweep(now, rest)
                if now >= next_status:
                    next_status = now + status.interval
                    status.report(self._counts())
        finally:
            # Awaited, so that a commit it had under way is pending again for release().
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)

    def _group_refusal(self, exc: GroupError) -> OutboxError | None:
        """A group error no retry can fix, as a configuration error (exit 2): a duplicate
        instance id, a session timeout the brokers refuse."""
        if self._membership is not None and is_fenced(exc):
            return self._membership.duplicate(f"Kafka: {exc}")
        return session_refused(exc, self._session_timeout_ms, self._membership is not None)

    def _lane(
        self,
        tp: Partition,
        sessions: async_sessionmaker[AsyncSession],
        sink: KafkaSink,
    ) -> Lane:
        assert self._kafka is not None and self.metrics is not None
        lane = self._lanes.get(tp)
        if lane is None:
            processor = PartitionProcessor(
                app=self.app,
                config=self.settings.consumer,
                store=self._store,
                sessions=sessions,
                connections=self._connections,
                sink=sink,
                policy=self._policy,
                metrics=self.metrics,
                topic=tp.topic,
                partition=tp.partition,
            )
            lane = Lane(self._host, tp, processor, self.app.decoder(tp.topic))
            processor.on_progress = lane.progress
            self._lanes[tp] = lane
            lane.task = asyncio.create_task(lane.work(), name=f"lane {tp.topic}[{tp.partition}]")
            lane.task.add_done_callback(self._watch)
        return lane

    def _watch(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            # A bug, not a handler error (those are handled): stop the daemon loudly.
            self._failure = task.exception()
            log.error("consumer task died: %r", self._failure, exc_info=self._failure)

    # ------------------------------------------------------------------ the sharer

    def _offer(self, lane: Lane) -> None:
        """``lane`` has records: the sharer takes them along in its next shared transaction
        or hands them to the lane's own task."""
        self._offered[lane.tp] = lane
        self._offers.set()

    async def _share(self) -> None:
        """Shared transactions, one at a time, for the short runs of the lanes offered since
        the last one (at a trickle: a fetch's records, whatever their partitions)."""
        while True:
            await self._offers.wait()
            self._offers.clear()
            # No slot: the partitions that are caught up never wait for those behind
            # (inbox/lane.py); one shared transaction at a time, on a connection of its own.
            await self._share_once()

    async def _share_once(self) -> None:
        limit = self.settings.consumer.max_batch_records
        runs: dict[Partition, Sequence[InboxEvent] | None] = {}
        for tp, lane in list(self._offered.items()):
            if lane.busy or not lane.events:
                del self._offered[tp]  # whoever holds it offers what it leaves
            else:
                runs[tp] = lane.processor.ready_run(lane.queued)
        # Partitions behind (after a broker's failover, say) must not hold back those
        # caught up: while some lane runs on its own, or some partition brings a short run
        # and another a long one, only short runs share. A shared transaction carrying a
        # long run would hold every caught-up partition's records for as long (seconds,
        # with a handler's round trip per event on a busy host); the long run goes to its
        # lane's own task instead, beside the shared transaction.
        lengths = [len(run) for run in runs.values() if run is not None]
        mixed = bool(lengths) and min(lengths) <= SHORT_RUN < max(lengths)
        short = SHORT_RUN if mixed or self._slots.in_use() else limit
        members: list[tuple[PartitionProcessor, Sequence[InboxEvent]]] = []
        taken: list[Lane] = []
        size = 0
        for tp, run in runs.items():
            lane = self._offered[tp]
            if run is not None and len(run) > short:
                run = None
            if run is not None and size + len(run) > limit:
                self._offers.set()  # the next transaction takes it
                continue
            del self._offered[tp]
            if run is None:
                lane.wake.set()  # it cannot share: its own task runs it
                continue
            lane.busy = True
            taken.append(lane)
            members.append((lane.processor, run))
            size += len(run)
        if not members:
            return
        try:
            await process_together(members)
            # Any success says the database is back (see _Lane.work).
            self.database.ok()
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            self.dependency_of(exc).failed(infrastructure_cause(exc))
            for lane in taken:
                lane.wake.set()  # each retries on its own, with backoff
        finally:
            for lane in taken:
                lane.settle()

    # ------------------------------------------------------------------ lanes' callbacks

    def _offset_done(self, tp: Partition, offset: int) -> None:
        """A lane's records before ``offset`` committed in the database."""
        self._progress_at = time.monotonic()
        self._offsets.done(tp, offset)

    def _pause(self, tp: Partition) -> None:
        assert self._kafka is not None
        self._kafka.pause(tp)

    def _resume(self, tp: Partition) -> None:
        assert self._kafka is not None
        self._kafka.resume(tp)  # nothing when no longer assigned

    # ------------------------------------------------------------------ rebalances

    async def _on_assigned(self, assigned: list[Partition]) -> None:
        self._lag.assigned.update(assigned)
        membership = self._membership
        if membership is not None and (duplicate := membership.joined()) is not None:
            self._failure = self._failure or duplicate
        # The group's generation moves with each rebalance; a member that joined again
        # without one (a static member, say) gets its partitions at the same generation.
        kafka = self._kafka
        log.info(
            "partitions assigned",
            extra={
                "partitions": sorted(str(tp) for tp in assigned),
                "generation": kafka.group_generation() if kafka is not None else None,
            },
        )

    async def release(self, tps: Sequence[Partition], stopping: bool = False) -> None:
        """Stop the given partitions after their current run, wait, and commit their offsets
        (``stopping``: within ``KAFKA_AT_STOP_SECONDS``).

        Records fetched but not started are dropped: the next owner reads them again from
        the committed offset.
        """
        lanes = [lane for tp in tps if (lane := self._lanes.pop(tp, None)) is not None]
        for lane in lanes:
            if self._offered.get(lane.tp) is lane:
                del self._offered[lane.tp]  # not taken along by a shared transaction any more
        for lane in lanes:
            lane.processor.stopping.set()
            lane.wake.set()
        await asyncio.gather(*(lane.task for lane in lanes if lane.task), return_exceptions=True)
        commit = functools.partial(self._offsets.flush, only=[lane.tp for lane in lanes])
        if stopping:
            await _at_stop(
                commit,
                "the last offset commit",
                "the partitions' next reader starts from the last committed offset, and the "
                "inbox skips what was applied",
            )
        else:
            await commit()
        for tp in tps:  # the next owner reports these partitions' lag
            self._offsets.forget(tp)
            self._lag.forget(tp)
        if lanes:
            log.info("partitions released", extra={"partitions": sorted(str(x.tp) for x in lanes)})


async def _at_stop(step: Callable[[], Awaitable[Any]], what: str, without: str) -> None:
    """``step`` (a request to Kafka, at stop), given up after ``KAFKA_AT_STOP_SECONDS``;
    ``without``: what that costs (never an event)."""
    try:
        await asyncio.wait_for(step(), KAFKA_AT_STOP_SECONDS)
    except TimeoutError:
        log.warning(
            "Kafka did not answer %s within %.0f s; stopping without it (nothing is lost: %s)",
            what,
            KAFKA_AT_STOP_SECONDS,
            without,
        )

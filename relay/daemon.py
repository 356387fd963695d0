"""The relay daemon: lane manager + pipelines + one Kafka producer, watched together.

Every background task is watched: if one fails (e.g. the schema is missing), the relay
stops the others and ``run`` raises that error. ``stop()`` (SIGTERM/SIGINT via
:meth:`Relay.serve`) lets in-flight batches finish for up to ``shutdown_grace_seconds``;
a batch still waiting after that is cancelled, which rolls its transaction back — its rows
stay in the outbox. Lanes are released by closing the lock connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from wsgiref.simple_server import WSGIServer

from outbox import kafka_room
from outbox.daemon import serve_http, stop_on_signals
from outbox.errors import ConfigurationError, DatabaseUnavailable, TopicMissing
from outbox.ops.topics import relay_topics
from outbox.poolers import SessionProbe
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay.crew import Crew
from relay.cursor import ClaimCursors
from relay.horizon import HorizonWatch
from relay.kafka_state import KafkaState
from relay.lanes import LaneManager, check_session
from relay.maintenance import run_maintenance
from relay.metrics import RelayMetrics
from relay.pipeline import Pipeline
from relay.publisher import Publisher
from relay.store import RelayStore
from relay.waiting import sleep_unless
from relay.wal_source import WalSource

log = logging.getLogger("relay")
_PREFLIGHT_SECONDS = 10
STATUS_EVERY_SECONDS = 10.0


class Relay:
    """``await Relay(settings).serve()`` runs until SIGTERM/SIGINT; ``run()`` until ``stop()``."""

    def __init__(self, settings: OutboxSettings, *, metrics_port: int | None = None) -> None:
        settings = settings.for_relay()  # its own URL, when relay.database_url is set
        self.settings = settings
        self.metrics = RelayMetrics(lanes=settings.lanes)
        self._metrics_port = metrics_port
        self._store = RelayStore(settings)
        self.cursors = ClaimCursors()
        self.lanes = LaneManager(settings, self._store, self.metrics, self.cursors)
        self._publisher = Publisher(settings, self.metrics)
        self._kafka = KafkaState(RetryPolicy.from_settings(settings.retry), self.metrics)
        # source = "wal": one reader of the replication slot instead of lanes and pipelines.
        self.wal = (
            WalSource(settings, self._publisher, self._kafka, self.metrics)
            if settings.source == "wal"
            else None
        )
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session: SessionProbe | None = None

    def stop(self) -> None:
        """Ask the relay to finish its in-flight batches and exit."""
        if self._stopping is not None:
            self._stopping.set()

    def healthy(self) -> bool:
        """Lock connection up, every task alive and no background task of the publisher
        dead (what ``/healthz`` reports)."""
        connected = self.lanes.connected if self.wal is None else self.wal.connected
        return (
            connected
            and bool(self._tasks)
            and not any(t.done() for t in self._tasks)
            and self._publisher.failure is None
        )

    async def _report(self, stopping: asyncio.Event) -> None:
        """A status line every ``STATUS_EVERY_SECONDS`` while running, like the consumer's:
        an operator tailing the log sees the relay work without a metrics scraper."""
        while not stopping.is_set():
            await sleep_unless(stopping, STATUS_EVERY_SECONDS)
            if not stopping.is_set():
                figures = self.metrics.status(self.settings.source)
                log.info("relay status", extra={"relay_id": self.lanes.relay_id, **figures})

    async def serve(self) -> None:
        """:meth:`run` with SIGTERM and SIGINT mapped to :meth:`stop`."""
        with stop_on_signals(self.stop):
            await self.run()

    async def preflight(self) -> None:
        """Fail fast, before taking lanes, on what no retry can fix: the database or Kafka
        refusing this configuration (credentials, unknown database, TLS), a transaction
        pooler in front of the database (see relay/lanes.py) and the topics of
        ``topics.names`` missing. Transient trouble (a database still starting, Kafka down)
        is left to the loops, which retry with backoff (and probe the session then)."""
        s = self.settings
        try:
            self._session = await check_session(s)
        except DatabaseUnavailable as exc:
            log.debug("database not ready at start", extra={"error": str(exc)})
        try:
            await asyncio.wait_for(self._publisher.ensure_started(), _PREFLIGHT_SECONDS)
        except ConfigurationError:  # refused by Kafka, or client settings that cannot work
            raise
        except Exception as exc:  # retried by the pipelines, logged once there
            log.debug("Kafka not ready at start", extra={"error": repr(exc)})
            return
        wanted = [spec.name for spec in relay_topics(s)]
        missing = [t for t in wanted if not await self._publisher.has_topic(t)]
        if missing:
            raise TopicMissing(", ".join(missing))

    async def run(self) -> None:
        kafka_room.check()  # one WARNING if this aiokafka lost a capability the relay uses
        await self.preflight()
        stopping = self._stopping = asyncio.Event()
        server: WSGIServer | None = None
        if self._metrics_port is not None:
            server = serve_http(
                self.metrics.registry, self._metrics_port, self.healthy, name="relay-http"
            )
        s = self.settings
        log.info(
            "relay starting",
            extra={
                "relay_id": self.lanes.relay_id,
                "source": s.source,
                "database": s.safe_database_url,
                "session": self._session.describe() if self._session else None,
                "kafka": s.kafka_bootstrap_servers,
                "pipelines": s.relay.pipelines,
                "batch_size": s.relay.batch_size,
                "metrics_port": self._metrics_port,
            },
        )
        if self.wal is not None:
            self._tasks = [
                asyncio.create_task(self.wal.run(stopping), name="wal"),
                asyncio.create_task(self.wal.watch(stopping), name="wal-gauges"),
            ]
        else:
            self._tasks = self._table_tasks(stopping)
        self._tasks.append(asyncio.create_task(self._report(stopping), name="status"))
        stop_wait = asyncio.create_task(stopping.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait(
                [*self._tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is not stop_wait and not task.cancelled() and task.exception():
                    failure = task.exception()
                    if not isinstance(failure, ConfigurationError):  # the CLI's one line
                        log.error(
                            "relay task failed; stopping",
                            extra={"task": task.get_name(), "error": repr(failure)},
                        )
        finally:
            stopping.set()
            stop_wait.cancel()
            await self._shutdown(server)
        if failure is not None:
            raise failure

    def _table_tasks(self, stopping: asyncio.Event) -> list[asyncio.Task[None]]:
        """The table source: the lane manager, the horizon watch and the pipelines."""
        s = self.settings
        crew = Crew(s.relay)
        pipelines = [
            Pipeline(
                i,
                s,
                self._store,
                self.lanes,
                self._publisher,
                self._kafka,
                self.metrics,
                self.cursors,
                crew,
            )
            for i in range(s.relay.pipelines)
        ]
        horizon = HorizonWatch(s, self._store, self.cursors, self.metrics, self.lanes.database)
        tasks = [
            asyncio.create_task(self.lanes.run(stopping), name="lanes"),
            asyncio.create_task(horizon.run(stopping), name="horizon"),
        ] + [
            asyncio.create_task(p.run(stopping), name=f"pipeline-{i}")
            for i, p in enumerate(pipelines)
        ]
        if s.relay.cleanup_interval_seconds > 0:
            tasks.append(
                asyncio.create_task(run_maintenance(s, stopping, self.cursors), name="maintenance")
            )
        return tasks

    async def _shutdown(self, server: WSGIServer | None) -> None:
        grace = self.settings.relay.shutdown_grace_seconds
        _, late = await asyncio.wait(self._tasks, timeout=grace)
        for task in late:
            task.cancel()
        if late:
            log.warning("cancelled in-flight work after grace period", extra={"tasks": len(late)})
            await asyncio.wait(late, timeout=2.0)
        # Work cancelled after the grace left its rows unacknowledged (they stay in the
        # outbox, or the slot reads them again): what its producers hold is not worth a flush.
        await self._publisher.stop(within=0.0 if late else 2.0)
        with contextlib.suppress(Exception):
            await self.lanes.close()
        if server is not None:
            server.shutdown()
        log.info("relay stopped", extra={"relay_id": self.lanes.relay_id})

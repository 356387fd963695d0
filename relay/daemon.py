"""The relay daemon: what every relay has, whatever its source, and its source's tasks,
watched together.

The daemon owns the relay's identity and its row in the relays table (relay/registration.py:
host, pid, source, lanes, maintenance), the Kafka side (relay/kafka/: the publisher and
Kafka's state), the verdict on what Kafka answered (relay/verdict.py), the metrics and the
status line, and the maintenance services it runs while it is their leader
(relay/maintenance/). Its source (relay/sources/: the outbox table, or a WAL slot) reads
events, hands them to the publisher and settles them.

Every task is watched: if one fails (e.g. the schema is missing), the relay stops the others
and ``run`` raises that error. ``stop()`` (SIGTERM/SIGINT via :meth:`Relay.serve`) lets
in-flight batches finish for up to ``shutdown_grace_seconds``; a batch still waiting after
that is cancelled, which rolls its transaction back (its rows stay in the outbox) or leaves
its events unconfirmed in the slot. Locks are released by closing their connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from wsgiref.simple_server import WSGIServer

from outbox.errors import ConfigurationError, DatabaseUnavailable, TopicMissing
from outbox.kafka import aiokafka_internals
from outbox.lifecycle import serve_http, stop_on_signals
from outbox.ops.topics import relay_topics
from outbox.outages import Dependency
from outbox.poolers import SessionProbe
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from outbox.status_line import StatusLine
from relay.database import Database
from relay.kafka.publisher import Publisher
from relay.kafka.state import KafkaState
from relay.maintenance import maintenance_for
from relay.maintenance.leader import Leadership
from relay.metrics import STATUS_DRIFTING, RelayMetrics
from relay.registration import Identity, Registration
from relay.sources import entry_for
from relay.sources.base import Shared
from relay.store import RelayStore
from relay.takeover import Takeover
from relay.verdict import Verdicts
from relay.waiting import sleep_unless

log = logging.getLogger("relay")
_PREFLIGHT_SECONDS = 10


class Relay:
    """``await Relay(settings).serve()`` runs until SIGTERM/SIGINT; ``run()`` until ``stop()``."""

    def __init__(self, settings: OutboxSettings, *, metrics_port: int | None = None) -> None:
        settings = settings.for_relay()  # its own URL, when relay.database_url is set
        self._settings = settings
        self._metrics_port = metrics_port
        self.identity = Identity()
        self.metrics = RelayMetrics(lanes=settings.lanes)
        self.database = Database(settings, (self.identity.pid, self.identity.hostname))
        # Shared by every task: one log line per database outage, and the status line's
        # "unknown" while it lasts.
        self._database_state = Dependency("database", log)
        entry = entry_for(settings)
        # Kafka through the client interface of outbox/kafka/client.py (aiokafka behind it).
        self._publisher = Publisher.from_settings(settings, entry.wording, self.metrics)
        retry = RetryPolicy.from_settings(settings.retry)
        self._kafka = KafkaState(retry, self.metrics)
        shared = Shared(
            identity=self.identity,
            database=self.database,
            database_state=self._database_state,
            db_retry=retry,
            publisher=self._publisher,
            kafka=self._kafka,
            metrics=self.metrics,
            verdicts=Verdicts(
                settings.relay.max_attempts, settings.retry, self._publisher.topic_missing
            ),
        )
        self.source = entry.make(settings, shared)
        store = RelayStore.of(settings)
        self.maintenance = maintenance_for(
            settings, self.database, store, self.metrics, self.source.retention_horizon
        )
        self.registration = Registration(
            self.identity,
            self.source.name,
            self.source.owned_lanes,
            self.database,
            store,
            shared.guard(),
            Leadership(store, self.maintenance),
            settings.relay.heartbeat_seconds,
            Takeover(self.identity.relay_id, store, self.metrics, settings.relay.takeover_seconds),
        )
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session: SessionProbe | None = None

    def stop(self) -> None:
        """Ask the relay to finish its in-flight batches and exit."""
        if self._stopping is not None:
            self._stopping.set()

    def healthy(self) -> bool:
        """The source's connections up, every task alive and no background task of the
        publisher dead (what ``/healthz`` reports)."""
        return (
            self.source.connected
            and bool(self._tasks)
            and not any(t.done() for t in self._tasks)
            and self._publisher.failure is None
        )

    def status(self) -> dict[str, int | float | str]:
        """The figures of the status line: every relay's, its source's, and the maintenance
        watches' on the relay that runs them; what the database gives is ``unknown`` while
        it is down."""
        up = self._database_state.up
        figures = {**self.metrics.status(), **self.source.status(up)}
        if self.maintenance.leading:
            figures |= self.metrics.vacuum_status(up)
        return figures

    async def _report(self, stopping: asyncio.Event) -> None:
        """The status line while running, like the consumer's (``outbox/status_line.py``:
        every ``status.interval_seconds``, at INFO when a figure changed)."""
        line = StatusLine(
            log,
            "relay status",
            self._settings.status,
            start=self.status(),
            drifting=STATUS_DRIFTING,
            fields={"relay_id": self.identity.relay_id},
        )
        while not stopping.is_set():
            await sleep_unless(stopping, line.interval)
            if not stopping.is_set():
                line.report(self.status())

    async def serve(self) -> None:
        """:meth:`run` with SIGTERM and SIGINT mapped to :meth:`stop`."""
        with stop_on_signals(self.stop):
            await self.run()

    async def preflight(self) -> None:
        """Fail fast, before taking lanes or the slot, on what no retry can fix: the
        database or Kafka refusing this configuration (credentials, unknown database, TLS),
        a transaction pooler in front of the database (relay/database.py) and the topics
        of ``topics.names`` missing. Transient trouble (a database still starting, Kafka
        down) is left to the loops, which retry with backoff (and probe the session then)."""
        try:
            self._session = await self.database.check_session()
        except DatabaseUnavailable as exc:
            log.debug("database not ready at start", extra={"error": str(exc)})
        try:
            await asyncio.wait_for(self._publisher.ensure_started(), _PREFLIGHT_SECONDS)
        except ConfigurationError:  # refused by Kafka, or client settings that cannot work
            raise
        except Exception as exc:  # retried by the source's loops, logged once there
            log.debug("Kafka not ready at start", extra={"error": repr(exc)})
            return
        wanted = [spec.name for spec in relay_topics(self._settings)]
        missing = [t for t in wanted if not await self._publisher.has_topic(t)]
        if missing:
            raise TopicMissing(", ".join(missing))

    async def run(self) -> None:
        aiokafka_internals.check()  # one WARNING if this aiokafka lost a capability we use
        await self.preflight()
        stopping = self._stopping = asyncio.Event()
        server: WSGIServer | None = None
        if self._metrics_port is not None:
            server = serve_http(
                self.metrics.registry, self._metrics_port, self.healthy, name="relay-http"
            )
        s = self._settings
        log.info(
            "relay starting",
            extra={
                "relay_id": self.identity.relay_id,
                "source": self.source.name,
                "database": self.database.safe_url,
                "session": self._session.describe() if self._session else None,
                # The server reached (host, port, primary or standby), not the URL's first.
                "server": self._session.address if self._session else None,
                "kafka": s.kafka_bootstrap_servers,
                "pipelines": s.relay.pipelines,
                "batch_size": s.relay.batch_size,
                "metrics_port": self._metrics_port,
            },
        )
        work = {
            **self.source.tasks(stopping),
            "registration": self.registration.run(stopping),
            "maintenance": self.maintenance.run(stopping),
            "status": self._report(stopping),
        }
        self._tasks = [asyncio.create_task(job, name=name) for name, job in work.items()]
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

    async def _shutdown(self, server: WSGIServer | None) -> None:
        grace = self._settings.relay.shutdown_grace_seconds
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
            await self.source.close()
        with contextlib.suppress(Exception):
            await self.registration.close()
        if server is not None:
            server.shutdown()
        log.info("relay stopped", extra={"relay_id": self.identity.relay_id})

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
import signal
from wsgiref.simple_server import WSGIServer

from outbox.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay.kafka_state import KafkaState
from relay.lanes import LaneManager
from relay.maintenance import run_maintenance
from relay.metrics import RelayMetrics, serve
from relay.pipeline import Pipeline
from relay.publisher import Publisher
from relay.store import RelayStore

log = logging.getLogger("relay")


class Relay:
    """``await Relay(settings).serve()`` runs until SIGTERM/SIGINT; ``run()`` until ``stop()``."""

    def __init__(self, settings: OutboxSettings, *, metrics_port: int | None = None) -> None:
        self.settings = settings
        self.metrics = RelayMetrics()
        self._metrics_port = metrics_port
        self._store = RelayStore(settings)
        self.lanes = LaneManager(settings, self._store, self.metrics)
        self._publisher = Publisher(settings)
        self._kafka = KafkaState(RetryPolicy.from_settings(settings.retry), self.metrics)
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def stop(self) -> None:
        """Ask the relay to finish its in-flight batches and exit."""
        if self._stopping is not None:
            self._stopping.set()

    def healthy(self) -> bool:
        """Lock connection up and every task alive (what ``/healthz`` reports)."""
        return self.lanes.connected and bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def serve(self) -> None:
        """:meth:`run` with SIGTERM and SIGINT mapped to :meth:`stop`."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            await self.run()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def run(self) -> None:
        stopping = self._stopping = asyncio.Event()
        server: WSGIServer | None = None
        if self._metrics_port is not None:
            server = serve(self.metrics, self._metrics_port, self.healthy)
        s = self.settings
        log.info(
            "relay starting",
            extra={
                "relay_id": self.lanes.relay_id,
                "database": s.safe_database_url,
                "kafka": s.kafka_bootstrap_servers,
                "pipelines": s.relay.pipelines,
                "batch_size": s.relay.batch_size,
                "metrics_port": self._metrics_port,
            },
        )
        pipelines = [
            Pipeline(i, s, self._store, self.lanes, self._publisher, self._kafka, self.metrics)
            for i in range(s.relay.pipelines)
        ]
        self._tasks = [asyncio.create_task(self.lanes.run(stopping), name="lanes")] + [
            asyncio.create_task(p.run(stopping), name=f"pipeline-{i}")
            for i, p in enumerate(pipelines)
        ]
        if s.relay.cleanup_interval_seconds > 0:
            self._tasks.append(
                asyncio.create_task(run_maintenance(s, stopping), name="maintenance")
            )
        stop_wait = asyncio.create_task(stopping.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait(
                [*self._tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is not stop_wait and not task.cancelled() and task.exception():
                    failure = task.exception()
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
        grace = self.settings.relay.shutdown_grace_seconds
        _, late = await asyncio.wait(self._tasks, timeout=grace)
        for task in late:
            task.cancel()
        if late:
            log.warning("cancelled in-flight work after grace period", extra={"tasks": len(late)})
            await asyncio.wait(late, timeout=2.0)
        await self._publisher.stop(within=2.0)
        with contextlib.suppress(Exception):
            await self.lanes.close()
        if server is not None:
            server.shutdown()
        log.info("relay stopped", extra={"relay_id": self.lanes.relay_id})

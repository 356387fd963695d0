"""What every daemon process shares (the relay, the consumer, the console): its HTTP
endpoint for ``/metrics`` and ``/healthz``, SIGTERM/SIGINT mapped to a graceful stop, and
the supervision of background tasks that must not die unnoticed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def supervise(
    task: asyncio.Task[Any], what: str, logger: logging.Logger, died: Callable[[], None]
) -> None:
    """Watch a background task that should only end when cancelled (a leader watch, a
    metadata watch, an offset committer): an exception ends it unobserved otherwise. Its
    death is logged at ERROR with the cause, and ``died()`` fails the daemon's health."""

    def done(finished: asyncio.Task[Any]) -> None:
        if finished.cancelled() or finished.exception() is None:
            return
        error = finished.exception()
        logger.error("%s died: %r", what, error, exc_info=error)
        died()

    task.add_done_callback(done)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line."""


def serve_http(
    registry: CollectorRegistry,
    port: int,
    healthy: Callable[[], bool],
    *,
    name: str = "daemon-http",
) -> WSGIServer:
    """Serve ``/metrics`` and ``/healthz`` (200 when ``healthy()``, else 503) on a daemon
    thread; ``server.shutdown()`` stops it."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            ok = healthy()
            start("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"unhealthy\n"]
        result: Iterable[bytes] = prometheus(environ, start)
        return result

    server = make_server("0.0.0.0", port, app, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Within the running event loop, SIGTERM and SIGINT call ``stop`` (a graceful stop:
    the daemon finishes or releases its in-flight batch) instead of killing the process."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def early_stop_signals() -> Iterator[threading.Event]:
    """Before the event loop runs (imports, connecting), a signal must also mean "stop
    cleanly": the returned event is set and the daemon stops as soon as it starts."""
    early = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: early.set()) for sig in STOP_SIGNALS}
    try:
        yield early
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

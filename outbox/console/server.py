"""The console as a process, at the daemons' standard: it checks the database before it
listens (a refusal or a missing schema is one line and exit 2; an outage is said and the
console starts anyway, its ``/healthz`` answering 503 until the database is back), binds
its port itself (taken: one line, exit 2 — not uvicorn's own line and exit 3), says where
it listens in one line, and stops on SIGTERM/SIGINT with exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from outbox import migrate
from outbox.errors import ConfigurationError, DatabaseUnavailable
from outbox.lifecycle import stop_on_signals
from outbox.settings import OutboxSettings


def check_database(settings: OutboxSettings) -> str | None:
    """Refuse a database that refuses us or lacks the tables this version reads (a
    ConfigurationError: exit 2); None when all is well, else why the database cannot be
    reached now (the console starts anyway)."""
    try:
        migrate.check_schema(settings)
    except DatabaseUnavailable as exc:
        return str(exc)
    return None


def listen(host: str, port: int) -> socket.socket:
    """The console's listening socket, bound now (so a taken port is said at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigurationError(
                f"port {port} on {host} is in use: stop what listens there or pass --port"
            ) from None
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The console's own handlers (stop_on_signals) stop it; uvicorn's would re-raise
        # the signal after the stop and end the process with 143.
        yield


async def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM/SIGINT, then finish and return."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = _Server(config)

    def stop() -> None:
        server.should_exit = True

    with stop_on_signals(stop):
        await server.serve(sockets=[sock])
    if server.started is False:  # the lifespan failed: uvicorn said why
        raise ConfigurationError("the console did not start (see the line above)")


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(app: Starlette, sock: socket.socket) -> None:
    asyncio.run(serve(app, sock))

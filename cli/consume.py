"""``outbox consume MODULE:ATTR``: run an inbox consumer until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import socket
import threading

import typer

from cli.context import notice, run, settings_of
from inbox import Consumer, ConsumerAppNotFound, ConsumerDaemon, Metrics
from outbox import aio
from outbox.errors import ConfigurationError
from outbox.imports import import_target
from outbox.lifecycle import early_stop_signals, serve_http, stop_on_signals
from outbox.settings import ConsumerSettings, OutboxSettings
from outbox.wording import counted

# The consumer's counters (inbox/metrics.py) whose name is a plural noun.
_SINGULAR = {
    "duplicates": "duplicate",
    "retries": "retry",
    "dead_letters_refused": "dead_letter_refused",
    "transactions": "transaction",
}


def load_consumer(target: str) -> Consumer:
    """The consumer ``module:attribute`` names (see :func:`outbox.imports.import_target`)."""
    try:
        app = import_target(target)
    except ValueError as exc:
        raise ConsumerAppNotFound(str(exc)) from None
    if not isinstance(app, Consumer):
        raise ConsumerAppNotFound(f"{target!r} is not an inbox.Consumer (got {type(app).__name__})")
    return app


def with_instance_id(settings: OutboxSettings, template: str | None) -> OutboxSettings:
    """``settings`` with ``--instance-id`` as consumer.group_instance_id (validated)."""
    if template is None:
        return settings
    fields = {**settings.consumer.model_dump(), "group_instance_id": template}
    try:
        consumer = ConsumerSettings.model_validate(fields)
    except ValueError as exc:  # pydantic's ValidationError; it echoes no secret here
        problems = "; ".join(str(e["msg"]) for e in getattr(exc, "errors", list)())
        raise ConfigurationError(f"--instance-id: {problems or exc}") from None
    return settings.model_copy(update={"consumer": consumer})


async def _serve(daemon: ConsumerDaemon, early_stop: threading.Event) -> None:
    stop = asyncio.Event()
    with stop_on_signals(stop.set):
        if early_stop.is_set():
            stop.set()
        await daemon.run(stop)


def consume(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="The consumer object, as module:attribute."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve Prometheus metrics on this port."
    ),
    instance_id: str | None = typer.Option(
        None,
        "--instance-id",
        help="Static group membership: this process's group instance id, stable across "
        "restarts and unique per process; {hostname} is replaced by the host name "
        "(default: OUTBOX_CONSUMER__GROUP_INSTANCE_ID).",
    ),
) -> None:
    """Run an inbox consumer: effectively-once handlers, retries, dead letters.

    SIGTERM/SIGINT finish the in-flight batches, commit their offsets and exit 0.
    """
    with early_stop_signals() as early_stop:
        settings = settings_of(ctx)
        app = run(lambda: load_consumer(target))
        settings = run(lambda: with_instance_id(app.settings or settings, instance_id))
        member = run(lambda: settings.consumer.instance_id(socket.gethostname()))
        metrics = Metrics(app.name)
        daemon = ConsumerDaemon(app, settings, metrics)
        server = None
        if metrics_port is not None:
            server = serve_http(metrics.registry, metrics_port, daemon.healthy, name="inbox-http")
        notice(
            f"consumer {app.name} on {', '.join(app.topics)} "
            f"({counted(len(app.handlers) + len(app.topic_handlers), 'handler')}, "
            f"database {daemon.settings.safe_database_url}"
            + (f", group instance id {member}" if member else "")
            + ")",
            consumer=app.name,
            topics=list(app.topics),
            group_instance_id=member,
        )
        try:
            run(lambda: aio.run_daemon(_serve(daemon, early_stop)))
        finally:
            if server is not None:
                server.shutdown()
    counts = metrics.counts
    summary = ", ".join(
        f"{n} {(_SINGULAR.get(name, name) if n == 1 else name).replace('_', ' ')}"
        for name, n in counts.items()
    )
    notice(f"stopped: {summary}", style="green", consumer=app.name, **counts)

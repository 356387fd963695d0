"""``outbox console``: serve the operator console (outbox/console). The adapter wires the
inbox's dead letters and the relay's failed-row functions into it: only the CLI may import
both."""

from __future__ import annotations

from typing import Any

import typer

from cli.context import notice, run, settings_of
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings


def _app(settings: OutboxSettings, allow_actions: bool) -> Any:
    from inbox import DeadLetters
    from outbox.console import Backends, FailedRows, create_app
    from relay.failed import list_failed, purge_failed, retry_failed

    failed = FailedRows(
        list=lambda topic, limit: list_failed(settings, topic=topic, limit=limit),
        retry=lambda ids: retry_failed(settings, ids),
        discard=lambda ids: purge_failed(settings, ids),
    )
    return create_app(
        settings, Backends(DeadLetters(settings), failed), allow_actions=allow_actions
    )


def console(
    ctx: typer.Context,
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on; not loopback needs a token."
    ),
    port: int = typer.Option(8090, "--port", min=1, max=65535),
    allow_actions: bool = typer.Option(
        False,
        "--allow-actions",
        help="Allow replay, purge, retry, discard and effect verdicts (default: read-only).",
    ),
) -> None:
    """Serve the operator console: lag, consumers, dead letters by error, failed rows,
    effects. SIGTERM/SIGINT stop it (exit 0)."""
    settings = settings_of(ctx)

    def prepare() -> tuple[Any, Any, str | None]:
        try:
            from outbox.console import check_bind, server
        except ImportError as exc:  # starlette / jinja2 / uvicorn missing
            raise ConfigurationError(
                f"the console needs the console extra: pip install 'outbox-inbox[console]' ({exc})"
            ) from None
        check_bind(host, settings)
        down = server.check_database(settings)
        sock = server.listen(host, port)
        return server, sock, down

    server, sock, down = run(prepare)
    app = run(lambda: _app(settings, allow_actions))
    mode = "actions allowed" if allow_actions else "read-only"
    door = "token required" if settings.console.token is not None else "no token: loopback only"
    notice(
        f"console on {server.url_of(host, port)} ({mode}, {door}, database "
        f"{settings.safe_database_url})",
        url=server.url_of(host, port),
        allow_actions=allow_actions,
    )
    if down is not None:
        notice(f"warning: {down}; /healthz answers 503 until it is back", style="yellow")
    run(lambda: server.run(app, sock))
    notice("console stopped", style="green")

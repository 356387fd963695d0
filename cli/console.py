"""``outbox console``: serve the operator console (outbox/console). The adapter wires the
inbox's dead letters and the relay's failed-row functions into it: only the CLI may import
both."""

from __future__ import annotations

import typer

from cli.context import run, settings_of
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings


def _app(settings: OutboxSettings, allow_actions: bool) -> object:
    try:
        from outbox.console import Backends, FailedRows, create_app
    except ImportError as exc:  # starlette / jinja2 missing
        raise ConfigurationError(
            f"the console needs the console extra: pip install 'outbox-inbox[console]' ({exc})"
        ) from None
    from inbox import DeadLetters
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
    """Serve the operator console: lag, dead letters by error, failed rows, effects."""
    settings = settings_of(ctx)

    def prepare() -> object:
        from outbox.console import check_bind

        check_bind(host, settings)
        return _app(settings, allow_actions)

    app = run(prepare)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)  # type: ignore[arg-type]

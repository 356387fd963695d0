"""Root of the ``outbox`` command. Each sub-command module registers itself here."""

from __future__ import annotations

import typer

from cli import config, consume, db, dlq, ops, relay
from cli.context import configure_logging

app = typer.Typer(
    name="outbox",
    help="Transactional outbox and inbox for PostgreSQL and Kafka.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals may hold DSNs with passwords
)
app.add_typer(db.app, name="db")
app.add_typer(config.app, name="config")
app.command("consume")(consume.consume)
app.add_typer(dlq.app, name="dlq")
app.add_typer(ops.app)  # lag, doctor, status, cleanup
app.add_typer(relay.app)  # relay, failed list|retry|purge


@app.callback()
def _root(
    log_level: str = typer.Option("INFO", "--log-level", envvar="OUTBOX_LOG_LEVEL"),
    json_logs: bool = typer.Option(False, "--json-logs", help="One JSON object per log line."),
) -> None:
    configure_logging(log_level, json_logs)


def main() -> None:
    app()

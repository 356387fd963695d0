"""What every command shares: the settings (loaded once), the consoles, operator messages,
error reporting and the confirmation of destructive actions.

Output contract: results go to stdout (``out``); messages to the operator go to stderr
through :func:`notice` — Rich text for humans, one JSON log record per message under
``--json-logs``, so stderr never mixes the two formats.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer
from rich.console import Console
from sqlalchemy.exc import StatementError

from outbox.errors import ConfigurationError, OutboxError
from outbox.outages import limit_third_party_logs
from outbox.settings import OutboxSettings, load_settings

console = Console(stderr=True)
out = Console()
T = TypeVar("T")


def print_json(value: Any) -> None:
    """``value`` as one line of JSON on stdout (no markup, no wrapping)."""
    out.print(json.dumps(value), markup=False, highlight=False, soft_wrap=True)


_log = logging.getLogger("outbox.cli")
_json_logs = False


def settings_of(ctx: typer.Context) -> OutboxSettings:
    """The settings built by the root callback (from OUTBOX_* and CLI overrides)."""
    settings = ctx.find_root().obj
    if not isinstance(settings, OutboxSettings):
        with reported_errors():
            settings = load_settings()
        ctx.find_root().obj = settings
    return settings


def notice(
    text: str, *, style: str | None = None, level: int = logging.INFO, **fields: Any
) -> None:
    """Tell the operator something on stderr, whatever the log level (like a command's
    result): a styled line, or under ``--json-logs`` one JSON record with ``fields`` as keys
    (the text must say what matters by itself: humans do not see ``fields``)."""
    if _json_logs:
        record = _log.makeRecord(_log.name, level, "cli", 0, text, (), None, extra=fields)
        _log.handle(record)  # handle(), not log(): the level filter does not apply
        return
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def error(text: str, **fields: Any) -> None:
    shown = text if _json_logs else f"error: {text}"  # JSON has the level as a field
    notice(shown, style="bold red", level=logging.ERROR, **fields)


def describe(exc: BaseException) -> str:
    """``Class: first line of the message`` — never a SQL statement or its parameters
    (SQLAlchemy appends both to the driver's message)."""
    cause = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


@contextmanager
def reported_errors() -> Iterator[None]:
    """Print a framework error as one clear line and exit 1 (2 for configuration)."""
    try:
        yield
    except OutboxError as exc:
        _log.debug("the error's traceback", exc_info=True)  # shown with --log-level debug
        error(describe(exc))
        raise typer.Exit(2 if isinstance(exc, ConfigurationError) else 1) from None


def run(fn: Callable[[], T]) -> T:
    with reported_errors():
        return fn()


def confirm(question: str, *, yes: bool) -> None:
    """Ask before a destructive action unless ``--yes``; without a terminal to ask on,
    refuse (exit 1) rather than guess."""
    if yes:
        return
    if not sys.stdin.isatty():
        error(f"refusing to {question} without --yes (no terminal to ask for confirmation)")
        raise typer.Exit(1)
    if not typer.confirm(f"{question[0].upper()}{question[1:]}?", err=True):
        notice("nothing done")
        raise typer.Exit(1)


def not_found(what: str, missing: list[Any]) -> None:
    """Exit 1 when some of the ids the operator named do not exist."""
    if missing:
        error(f"no {what} with id {', '.join(map(str, missing))}")
        raise typer.Exit(1)


def configure_logging(level: str, json_logs: bool) -> None:
    from outbox.logs import setup_logging

    global _json_logs
    _json_logs = json_logs
    setup_logging(level=level, json_logs=json_logs)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    # Alembic narrates every schema look-up at INFO ("Context impl PostgresqlImpl.", "Will
    # assume transactional DDL."): commands print their own answer, Alembic only at DEBUG.
    # `outbox db upgrade` reports the revisions it applies itself.
    debug = logging.getLevelName(level.upper()) == logging.DEBUG
    logging.getLogger("alembic").setLevel(logging.NOTSET if debug else logging.WARNING)
    limit_third_party_logs()  # aiokafka repeats itself every ~200 ms during an outage

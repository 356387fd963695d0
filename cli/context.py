"""What every command shares: the settings (loaded once), the consoles, operator messages,
error reporting and the confirmation of destructive actions.

Output contract: results go to stdout (``out``); messages to the operator go to stderr
through :func:`notice` — Rich text for humans, one JSON log record per message under
``--json-logs``, so stderr never mixes the two formats. On a terminal results fit its
width; anywhere else (a pipe, a log, CI, ``kubectl logs``) they are plain lines, never
wrapped or cut, whatever ``COLUMNS`` says: ids and names stay whole for grep and scripts.

Errors have one form, ``error: Class: message`` (:func:`error`): exit 2 for a usage or
configuration error, 1 for an operation that failed (:func:`exit_code`).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import StatementError

from outbox.errors import AmbiguousId, ConfigurationError, NotFound, OutboxError
from outbox.outages import limit_third_party_logs
from outbox.settings import OutboxSettings, load_settings

console = Console(stderr=True)
# Wide enough for any line a command prints (a table's row of ids, names, an error).
_PIPE_WIDTH = 10_000


def _results() -> Console:
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=_PIPE_WIDTH, soft_wrap=True)


out = _results()
T = TypeVar("T")


def table(*columns: str, title: str | None = None) -> Table:
    """A result table: boxed on a terminal, plain aligned columns elsewhere (print it with
    :func:`print_results`)."""
    if out.is_terminal:
        return Table(*columns, title=title)
    return Table(*columns, title=title, box=None, pad_edge=False, title_justify="left")


def print_results(*renderables: Any) -> None:
    """Print results; outside a terminal without the padding Rich adds at line ends."""
    if out.is_terminal:
        out.print(*renderables)
        return
    with out.capture() as captured:
        out.print(*renderables)
    out.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


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
    """``text`` is ``Class: message`` (:func:`describe`, :func:`usage`)."""
    shown = text if _json_logs else f"error: {text}"  # JSON has the level as a field
    notice(shown, style="bold red", level=logging.ERROR, **fields)


def usage(message: str) -> NoReturn:
    """The command line asks for something impossible: one line, exit 2."""
    error(f"UsageError: {message}")
    raise typer.Exit(2)


def fail(exc: OutboxError) -> NoReturn:
    """Report ``exc`` as every framework error is reported, and exit."""
    error(describe(exc))
    raise typer.Exit(exit_code(exc))


def exit_code(exc: OutboxError) -> int:
    """2 when the input must change (configuration, an ambiguous id), else 1."""
    return 2 if isinstance(exc, ConfigurationError | AmbiguousId) else 1


def describe(exc: BaseException) -> str:
    """``Class: first line of the message`` — never a SQL statement or its parameters
    (SQLAlchemy appends both to the driver's message)."""
    cause = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


@contextmanager
def reported_errors() -> Iterator[None]:
    """Print a framework error as one clear line and exit (:func:`exit_code`)."""
    try:
        yield
    except OutboxError as exc:
        _log.debug("the error's traceback", exc_info=True)  # shown with --log-level debug
        fail(exc)


def run(fn: Callable[[], T]) -> T:
    with reported_errors():
        return fn()


def confirm(question: str, *, yes: bool) -> None:
    """Ask before a destructive action unless ``--yes``; without a terminal to ask on,
    refuse (a usage error: exit 2) rather than guess."""
    if yes:
        return
    if not sys.stdin.isatty():
        usage(f"refusing to {question} without --yes (no terminal to ask for confirmation)")
    if not typer.confirm(f"{question[0].upper()}{question[1:]}?", err=True):
        notice("nothing done")
        raise typer.Exit(1)


def not_found(what: str, missing: list[Any]) -> None:
    """Exit 1 when some of the ids the operator named do not exist."""
    if missing:
        fail(NotFound(f"no {what} with id {', '.join(map(str, missing))}"))


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

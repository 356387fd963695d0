"""Root of the ``outbox`` command. Each sub-command module registers itself here.

The root's options (``--log-level``, ``--json-logs``, ``--env-file``) are global: they are
accepted before or after the sub-command (``outbox relay --log-level debug``), see
:class:`RootGroup`.
No input shows a traceback unless the log level is DEBUG (:func:`main`).
"""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from cli import config, console, consume, db, dlq, effects, ops, relay, topics, wal
from cli.context import configure_logging, describe, error, run
from cli.params import plain_help_types, plain_type
from outbox.settings import load_settings


class RootGroup(TyperGroup):
    """Moves the root's own options to the front of the command line, wherever they were
    written, so every sub-command accepts them without declaring them (the option list
    comes from the root callback's parameters; ``--`` ends the search). Built with every
    command below it, it gives them all plain help types (:func:`cli.params.plain_help_types`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        plain_help_types(self)

    def get_params(self, ctx: Any) -> list[Any]:
        # The shell-completion flags are added to the root after it is built.
        return [plain_type(p) for p in super().get_params(ctx)]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's vendored Context
        return super().parse_args(ctx, self.hoist(args))

    def hoist(self, args: list[str]) -> list[str]:
        takes_value = {
            name: not getattr(p, "is_flag", False)
            for p in self.params
            if p.param_type_name == "option"
            for name in (*p.opts, *p.secondary_opts)
        }
        front: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            name = token.split("=", 1)[0]
            if token == "--":
                rest.extend(args[i:])
                break
            if name in takes_value:
                if takes_value[name] and "=" not in token and i + 1 < len(args):
                    front.extend(args[i : i + 2])
                    i += 2
                    continue
                front.append(token)
            else:
                rest.append(token)
            i += 1
        return front + rest


app = typer.Typer(
    name="outbox",
    cls=RootGroup,
    help="Transactional outbox and inbox for PostgreSQL and Kafka.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by sub-commands
    pretty_exceptions_show_locals=False,  # locals may hold DSNs with passwords
)
app.add_typer(db.app, name="db")
app.add_typer(config.app, name="config")
app.command("consume")(consume.consume)
app.command("console")(console.console)
app.add_typer(dlq.app, name="dlq")
app.add_typer(effects.app, name="effects")
app.add_typer(ops.app)  # lag, doctor, status, cleanup
app.add_typer(relay.app)  # relay, failed list|retry|purge
app.add_typer(topics.app, name="topics")
app.add_typer(wal.app, name="wal")


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


def package_version() -> str:
    try:
        return version("outbox-inbox")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"outbox-inbox {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    log_level: LogLevel = typer.Option(
        LogLevel.INFO,
        "--log-level",
        envvar="OUTBOX_LOG_LEVEL",
        case_sensitive=False,
        help="Also accepted after the sub-command. DEBUG shows tracebacks.",
    ),
    json_logs: bool = typer.Option(
        False, "--json-logs", help="One JSON object per stderr line (also after the sub-command)."
    ),
    env_file: Path | None = typer.Option(
        None,
        "--env-file",
        exists=True,
        dir_okay=False,
        help="Read OUTBOX_* settings from this dotenv file too (the environment wins).",
    ),
    _version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        expose_value=True,
        help="Print the version and exit.",
    ),
) -> None:
    configure_logging(log_level.value, json_logs)
    if env_file is not None:
        ctx.obj = run(lambda: load_settings(_env_file=env_file))


def main() -> None:
    """The console script. Every error is one line on stderr, ``error: Class: message`` (one
    JSON record under ``--json-logs``): click's usage errors (exit 2) as the commands' own,
    and an error nobody translated into a clear message (exit 1); ``--log-level debug``
    shows the latter's traceback."""
    args = sys.argv[1:]
    if "--json-logs" in args[: args.index("--") if "--" in args else None]:
        configure_logging(LogLevel.INFO, json_logs=True)  # the root callback sets the level
    try:
        code = app(prog_name="outbox", standalone_mode=False)  # also under `python -m cli`
    except typer.Abort:  # Ctrl-C or end of input at a prompt
        error("Abort: nothing done")
        code = 1
    except typer.TyperException as exc:  # click's usage errors: an option, an argument
        code = _usage_error(exc)
    except Exception as exc:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        error(f"{describe(exc)} (run with --log-level debug for the traceback)")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: typer.TyperException) -> int:
    """One line for a usage error; the help a command without arguments printed suffices."""
    code = getattr(exc, "exit_code", 2)
    if type(exc).__name__ == "NoArgsIsHelpError":  # typer printed the help already
        return int(code)
    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} -h`)" if ctx is not None else ""
    message = getattr(exc, "format_message", exc.__str__)()
    error(f"{type(exc).__name__}: {message}{hint}")
    return int(code)

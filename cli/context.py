"""What every command shares: the settings (loaded once) and the console."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import typer
from rich.console import Console

from outbox.errors import ConfigurationError, OutboxError
from outbox.settings import OutboxSettings, load_settings

console = Console(stderr=True)
out = Console()
T = TypeVar("T")


def settings_of(ctx: typer.Context) -> OutboxSettings:
    """The settings built by the root callback (from OUTBOX_* and CLI overrides)."""
    settings = ctx.find_root().obj
    if not isinstance(settings, OutboxSettings):
        with reported_errors():
            settings = load_settings()
        ctx.find_root().obj = settings
    return settings


@contextmanager
def reported_errors() -> Iterator[None]:
    """Print a framework error as one clear line and exit 1 (2 for configuration)."""
    try:
        yield
    except OutboxError as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(2 if isinstance(exc, ConfigurationError) else 1) from None


def run(fn: Callable[[], T]) -> T:
    with reported_errors():
        return fn()


def configure_logging(level: str, json_logs: bool) -> None:
    from outbox.logs import setup_logging

    setup_logging(level=level, json_logs=json_logs)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)

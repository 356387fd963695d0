"""Reference pages generated from the code: every ``outbox`` command, the error tree and the
SQLSTATE table of database errors.

The documentation site renders these at build time (``docs/_hooks/reference.py``), so the
pages cannot drift from the code; tests compare them with what the code defines. They live
here because only ``cli`` may import every package (``cli -> relay | inbox -> outbox``).
"""

from __future__ import annotations

import html
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import typer.main

from outbox.dberrors import SQLSTATES, DbTrouble
from outbox.errors import ConfigurationError, OutboxError

# Options every command has, or that only concern the shell: not worth a row each.
_BOILERPLATE = {"--help", "--install-completion", "--show-completion"}


@dataclass(frozen=True)
class Command:
    """One command of the CLI as the reference shows it."""

    path: tuple[str, ...]  # ("outbox", "dlq", "replay")
    help: str
    usage: str
    params: tuple[tuple[str, str], ...]  # (the option/argument as typed, its help)
    is_group: bool

    @property
    def name(self) -> str:
        return " ".join(self.path)


def commands() -> list[Command]:
    """The root and every visible command, depth first in registration order."""
    from cli.app import app  # here, not at import: cli.app imports every command module

    root = typer.main.get_command(app)
    return list(_walk(root, root.context_class(root, info_name="outbox"), ("outbox",)))


def _walk(cmd: Any, ctx: Any, path: tuple[str, ...]) -> Iterator[Command]:
    params = tuple(
        record
        for p in cmd.get_params(ctx)
        if (record := p.get_help_record(ctx)) is not None and p.opts[0] not in _BOILERPLATE
    )
    group = hasattr(cmd, "list_commands")
    usage = " ".join([*path, *cmd.collect_usage_pieces(ctx)])
    yield Command(path, inspect.cleandoc(cmd.help or ""), usage, params, group)
    if group:
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                sub_ctx = cmd.context_class(sub, parent=ctx, info_name=name)
                yield from _walk(sub, sub_ctx, (*path, name))


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_DOCTEST = re.compile(r"^([ \t]*)>>> .*(?:\n\1(?:>>>|\.\.\.|\S).*)*", re.M)


def markdown_docstring(text: str) -> str:
    """A docstring written for Sphinx, as Markdown: cross-reference roles become code
    (``:class:`~a.B` `` -> `` `B` ``), ``text::`` before a literal block becomes ``text:``,
    and doctest examples become fenced ``pycon`` blocks."""
    text = _ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.M)
    return _DOCTEST.sub(lambda m: f"{m[1]}```pycon\n{m[0]}\n{m[1]}```", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code_cell(text: str) -> str:
    """``text`` as code in a table cell: HTML, because Markdown keeps the backslash of an
    escaped ``|`` inside a code span (``--log-level <debug|info|…>``)."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>"


def cli_markdown() -> str:
    """The CLI reference page: usage, help and every option of every command."""
    parts: list[str] = []
    for c in commands():
        depth = min(len(c.path), 3)  # outbox -> h1 is the page title, so start at h2
        title = "Global options" if len(c.path) == 1 else f"`{c.name}`"
        parts += [f"{'#' * (depth + 1)} {title}", "", c.help, ""]
        if len(c.path) > 1:
            parts += ["```text", c.usage, "```", ""]
        if c.params:
            parts += ["| option / argument | meaning |", "| --- | --- |"]
            parts += [f"| {code_cell(flag)} | {_cell(help_)} |" for flag, help_ in c.params]
            parts.append("")
    return "\n".join(parts)


# Modules never imported to find error classes: Alembic's env runs migrations on import,
# and ``python -m cli`` runs the CLI.
_SKIP = re.compile(r"^outbox\.migrations\b|\.__main__\Z")
PACKAGES = ("outbox", "relay", "inbox", "cli")


def import_everything() -> None:
    """Import every module of the packages, so that every error class is defined."""
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not _SKIP.search(info.name):
                importlib.import_module(info.name)


def error_classes() -> list[type[OutboxError]]:
    """``OutboxError`` and all its subclasses, depth first, siblings by name."""
    import_everything()

    def tree(cls: type[OutboxError]) -> Iterator[type[OutboxError]]:
        yield cls
        for sub in sorted(cls.__subclasses__(), key=lambda c: c.__name__):
            yield from tree(sub)

    return list(tree(OutboxError))


def retriable(cls: type[OutboxError]) -> str:
    """ "yes", "no", or "by instance" for a class that sets the flag per error."""
    if re.search(r"self\.retriable\s*=", inspect.getsource(cls)):
        return "by instance"
    return "yes" if cls.retriable else "no"


def _depth(cls: type[OutboxError]) -> int:
    return sum(1 for base in cls.__mro__ if issubclass(base, OutboxError)) - 1


def errors_markdown() -> str:
    """The error reference page: the tree, then one entry per class from its docstring."""
    classes = error_classes()
    parts = ["```text"]
    parts += [f"{'    ' * _depth(c)}{c.__name__}" for c in classes]
    parts += ["```", ""]
    for c in classes:
        exit_code = 2 if issubclass(c, ConfigurationError) else 1
        parts += [
            f"### `{c.__name__}`",
            "",
            f"`{c.__module__}.{c.__qualname__}` · retriable: **{retriable(c)}** · "
            f"exit code of a CLI command stopped by it: **{exit_code}**",
            "",
            markdown_docstring(inspect.cleandoc(c.__doc__ or "")),
            "",
        ]
    return "\n".join(parts)


# What each kind of database error does, as the SQLSTATE table's rows say it.
_TROUBLE_EFFECT = {
    DbTrouble.OUTAGE: "outage: rolled back, retried after a backoff, logged once per state "
    "change; no attempt counted, nothing dead-lettered, moved to `failed` or parked",
    DbTrouble.CONFLICT: "conflict: the transaction runs again, no attempt counted (a "
    "handler's: at once, up to 5 times in a row, then it counts as a retryable failure; the "
    "relay's: after its database backoff)",
    DbTrouble.REFUSED: "refused: configuration; a daemon stops with exit code 2",
}


def database_errors_markdown() -> str:
    """The SQLSTATE table of ``outbox/dberrors.py``, one row per code or class."""
    rows = ["| SQLSTATE | what it says | what the framework does |", "| --- | --- | --- |"]
    for code, (kind, meaning) in SQLSTATES.items():
        shown = f"`{code}` (class)" if len(code) == 2 else f"`{code}`"
        rows.append(f"| {shown} | {_cell(meaning)} | {_cell(_TROUBLE_EFFECT[kind])} |")
    return "\n".join(rows)

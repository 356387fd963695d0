"""How the commands' options read and parse: one duration format everywhere, and help that
names what to type.

Durations are ``90s``, ``30m``, ``12h``, ``30d`` (a bare number is seconds) wherever a command
asks for one (:func:`duration`). Typer would show every flag as ``<bool>`` and a repeatable
option as ``<list[str]>``; :func:`plain_help_types` makes flags show nothing and repeatable
options their element's type (their help says "repeatable").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from logging import WARNING
from typing import Any

import typer
from typer.core import TyperArgument, TyperOption

from cli.context import notice

DURATION = "DURATION"  # the metavar of every duration option
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """``90``, ``90s``, ``15m``, ``36h``, ``7d`` -> seconds; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(value)
    if not match:
        raise ValueError(f"{value!r} is not a duration like 90s, 30m, 12h or 30d")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


def shown(seconds: float) -> str:
    """Seconds in the largest unit that divides them: 2592000 -> ``30d``, 90 -> ``90s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def duration(minimum: float = 0.0, *, above: bool = False) -> Callable[[Any], float]:
    """A typer ``parser`` for a duration option: seconds, at least ``minimum`` (above it
    with ``above``); a bad value is a usage error (exit 2) saying what is expected."""

    def parse(value: Any) -> float:
        if isinstance(value, int | float):  # a default given as a number
            return float(value)
        try:
            seconds = parse_duration(str(value))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if seconds < minimum or (above and seconds == minimum):
            bound = "above" if above else "at least"
            raise typer.BadParameter(f"{value!r} is not a duration {bound} {shown(minimum)}")
        return seconds

    return parse


class _PlainOption(TyperOption):
    def display_type(self, ctx: Any) -> str:
        return "" if self.is_flag else _element(super().display_type(ctx))


class _PlainArgument(TyperArgument):
    def display_type(self, ctx: Any) -> str:
        return _element(super().display_type(ctx))


def _element(shown_type: str) -> str:
    """``<list[str]>`` -> ``<str>``."""
    return re.sub(r"^<list\[(.*)\]>$", r"<\1>", shown_type)


def plain_help_types(command: Any) -> None:
    """Give ``command`` and every command below it the plain help types above (the
    parameters' own classes, with ``display_type`` changed: nothing else differs). The
    ``-h/--help`` flag is made when help is first asked for: it is changed then."""
    for param in command.params:
        plain_type(param)
    made = command.get_help_option

    def get_help_option(ctx: Any) -> Any:
        return plain_type(made(ctx))

    command.get_help_option = get_help_option
    for sub in getattr(command, "commands", {}).values():
        plain_help_types(sub)


def plain_type(param: Any) -> Any:
    """``param`` with a plain help type (changed in place)."""
    if type(param) is TyperOption:
        param.__class__ = _PlainOption
    elif type(param) is TyperArgument:
        param.__class__ = _PlainArgument
    return param


def renamed(
    value: float | None, old_value: float | None, *, old: str, new: str, unit: float = 1.0
) -> float | None:
    """The duration of option ``new`` (seconds), or of the deprecated option ``old`` (in
    ``unit`` seconds: 3600 for an ``-hours`` option) when given: it still works, and says
    what to write instead."""
    if old_value is None:
        return value
    seconds = old_value * unit
    notice(f"{old} is deprecated: write {new} {shown(seconds)}", style="yellow", level=WARNING)
    return seconds

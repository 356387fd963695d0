"""The root's options are global: hoisted to the front from wherever they were written.
Help names what to type."""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from cli import reference
from cli.app import RootGroup, app


def _root() -> RootGroup:
    group = typer.main.get_command(app)
    assert isinstance(group, RootGroup)
    return group


def test_global_options_after_the_sub_command_move_to_the_front() -> None:
    hoist = _root().hoist
    assert hoist(["relay", "--log-level", "debug"]) == ["--log-level", "debug", "relay"]
    assert hoist(["dlq", "list", "--json-logs", "--limit", "5"]) == [
        "--json-logs",
        "dlq",
        "list",
        "--limit",
        "5",
    ]
    assert hoist(["db", "upgrade", "--log-level=warning", "head"]) == [
        "--log-level=warning",
        "db",
        "upgrade",
        "head",
    ]


def test_other_options_and_everything_after_a_double_dash_stay_put() -> None:
    hoist = _root().hoist
    assert hoist(["lag", "--json", "--max-age", "5"]) == ["lag", "--json", "--max-age", "5"]
    assert hoist(["dlq", "show", "--", "--json-logs"]) == ["dlq", "show", "--", "--json-logs"]


def test_help_names_no_bool_or_list_types_for_any_command() -> None:
    """Flags show no type; a repeatable option shows its element's (``<str>``)."""
    runner = CliRunner()
    for command in reference.commands():
        result = runner.invoke(app, [*command.path[1:], "-h"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command.name, result.output)
        assert "<bool>" not in result.output and "<list[" not in result.output, (
            command.name,
            result.output,
        )
    lag = runner.invoke(app, ["lag", "-h"], env={"COLUMNS": "200"}).output
    assert re.search(r"--group\s+<str>", lag) and re.search(r"--interval\s+DURATION", lag)

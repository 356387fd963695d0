"""The root's options are global: hoisted to the front from wherever they were written."""

from __future__ import annotations

import typer.main

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

"""``outbox effects``: list, show and resolve side-effect ledger records."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar

import typer

from cli.context import notice, out, print_json, print_results, run, settings_of, table, usage
from outbox.db import sync_engine
from outbox.effects import EffectRecord, Effects
from outbox.settings import OutboxSettings
from outbox.wording import counted

app = typer.Typer(help="Inspect and resolve the side-effect ledger.", no_args_is_help=True)
T = TypeVar("T")


class State(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"


def _with(settings: OutboxSettings, action: Callable[[Effects, Any], T]) -> T:
    def go() -> T:
        engine = sync_engine(settings, pool_size=1, max_overflow=0)
        try:
            return action(Effects(settings), engine)
        finally:
            engine.dispose()

    return run(go)


@app.command("list")
def list_(
    ctx: typer.Context,
    state: State | None = typer.Option(None, "--state", help="Only records in this state."),
    limit: int = typer.Option(100, "--limit", min=1, help="At most this many."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array."),
) -> None:
    """List ledger records, most recently changed first (--state unknown: what needs you)."""
    records: list[EffectRecord] = _with(
        settings_of(ctx), lambda fx, engine: fx.records(engine, state, limit)
    )
    if as_json:
        print_json([r.to_dict() for r in records])
        return
    listed = table("key", "state", "dependency", "attempts", "updated", "last error")
    for r in records:
        listed.add_row(
            r.key,
            r.state + (" (live)" if r.state == "pending" and r.lease_live else ""),
            r.dependency,
            str(r.attempts),
            r.updated_at.isoformat(timespec="seconds"),
            r.last_error or "-",
        )
    print_results(listed)
    notice(counted(len(records), "effect"), count=len(records))


@app.command()
def show(
    ctx: typer.Context,
    key: str = typer.Argument(..., help="The effect's key."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object."),
) -> None:
    """Show one record: state, result or stored error, attempts, lease and window."""
    record: EffectRecord = _with(settings_of(ctx), lambda fx, engine: fx.get(engine, key))
    data = record.to_dict()
    if as_json:
        print_json(data)
        return
    for name, value in data.items():
        shown = json.dumps(value) if name in ("result", "error") else value
        out.print(f"[bold]{name}:[/] {shown}", highlight=False)


@app.command()
def resolve(
    ctx: typer.Context,
    key: str = typer.Argument(..., help="The effect's key."),
    applied: str | None = typer.Option(
        None,
        "--applied",
        metavar="RESULT_JSON",
        help="The effect did happen; store this JSON as its result (replayed from now on).",
    ),
    not_applied: bool = typer.Option(
        False, "--not-applied", help="The effect did not happen; the next caller calls again."
    ),
) -> None:
    """Decide an unknown effect (or a pending one whose caller died) after checking the
    dependency by hand. Exactly one of --applied / --not-applied."""
    if (applied is None) == (not not_applied):
        usage("give exactly one of --applied RESULT_JSON or --not-applied")
    result: Any = None
    if applied is not None:
        try:
            result = json.loads(applied)
        except ValueError as exc:
            usage(f"--applied is not valid JSON: {exc.args[0] if exc.args else exc}")
    _with(
        settings_of(ctx),
        lambda fx, engine: fx.resolve(engine, key, applied=applied is not None, result=result),
    )
    verdict = "applied (result stored)" if applied is not None else "not applied (claim released)"
    notice(f"effect {key} resolved: {verdict}", key=key, applied=applied is not None)

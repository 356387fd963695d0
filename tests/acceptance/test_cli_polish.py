"""The CLI where its output goes to a pipe, a log or a script, and where an operator types
ids and durations (subprocesses against the real services):

* every listing command, with stdout a pipe and ``COLUMNS=80``, prints whole ids and names
  on plain lines (no box, no ellipsis, no wrapped cell);
* an event id may be given by a unique prefix; an ambiguous one is a usage error (exit 2)
  saying how many it fits; ``dlq show`` needs ``-c`` only when the event is a dead letter
  of several consumers;
* the old duration options still work and say what to write instead;
* ``failed retry`` keeps the event id and gives the row a new one, as the docs say.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest
from sqlalchemy import Engine, insert, select, text

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.acceptance.conftest import Cli, SchemaFactory
from tests.acceptance.test_cli_ux import add_dead_letter
from tests.acceptance.test_lag_cli import move_to_failed, publish

pytestmark = pytest.mark.acceptance

LONG = "shop-shipping-notifications-consumer-eu-west-1"  # wider than its column at 80


def _piped(cli: Cli, *args: str) -> subprocess.CompletedProcess[str]:
    """``outbox ARGS | cat`` in a terminal 80 columns wide."""
    return subprocess.run(
        cli.command(*args),
        env={**cli.env, "COLUMNS": "80", "TERM": "xterm-256color"},
        capture_output=True,  # stdout is a pipe
        text=True,
        timeout=120,
        check=False,
    )


def _add_effect(engine: Engine, settings: OutboxSettings, key: str) -> None:
    t = build_tables(settings).effects
    with engine.begin() as conn:
        conn.execute(
            insert(t).values(
                key=key,
                payload_hash="0" * 64,
                state="unknown",
                dependency=f"{LONG}-payments-provider",
                last_error="ConnectionResetError: [Errno 104] Connection reset by peer",
                dedupe_window=text("interval '1 day'"),
            )
        )


def test_every_listing_command_in_a_pipe_prints_whole_ids_and_names(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    engine, cli = acceptance_engine, Cli(settings)
    event_id = str(uuid.uuid4())
    add_dead_letter(engine, settings, LONG, event_id)
    topic = f"{LONG}-orders-{uuid.uuid4().hex[:6]}"
    publish(engine, settings, topic, 3)
    move_to_failed(engine, settings, topic, 1)
    with engine.connect() as conn:
        [failed_event] = conn.execute(select(build_tables(settings).failed.c.event_id)).scalars()
    effect_key = f"refund:{LONG}:order-{uuid.uuid4()}"
    _add_effect(engine, settings, effect_key)

    wanted = {
        ("dlq", "list"): [LONG, event_id, "shop.orders[0]@7"],
        ("failed", "list"): [str(failed_event), topic],
        ("effects", "list"): [effect_key, f"{LONG}-payments-provider"],
        ("lag", "--no-kafka", "--group", LONG): [topic, LONG],
        ("doctor", "--topic", f"{topic}:3"): [f"outbox topics ensure --topic {topic}:3"],
        ("status", "--topic", topic): [LONG, settings.safe_database_url],
        ("db", "current"): ["current:"],
    }
    for args, names in wanted.items():
        proc = _piped(cli, *args)
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # doctor: a finding
        lines = proc.stdout.splitlines()
        for name in names:
            assert any(name in line for line in lines), (args, name, proc.stdout)
        assert "…" not in proc.stdout and "│" not in proc.stdout, (args, proc.stdout)
        assert all(line == line.rstrip() for line in lines), (args, proc.stdout)
    wide = _piped(cli, "dlq", "list").stdout.splitlines()
    assert max(map(len, wide)) > 80 and wide[0].split() == [
        "consumer",
        "event_id",
        "type",
        "origin",
        "error",
        "attempts",
        "state",
        "dlq",
        "at",
    ]
    assert wide[1].split()[:2] == [LONG, event_id] and wide[1].split()[6] == "forgotten"


def test_event_ids_by_a_unique_prefix_and_c_only_when_several_consumers(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    engine, cli = acceptance_engine, Cli(settings)
    ids = ["0a4f1111-0000-4000-8000-000000000001", "0a4f2222-0000-4000-8000-000000000002"]
    for event_id in ids:
        add_dead_letter(engine, settings, "shipping", event_id)
    add_dead_letter(engine, settings, "billing", ids[1])

    one = cli("dlq", "show", "0a4f1")
    assert one.returncode == 0, one.stderr
    assert f"event_id: {ids[0]}" in one.stdout and "consumer: shipping" in one.stdout
    assert "state: forgotten: its inbox row expired" in one.stdout  # none was written here

    ambiguous = cli("dlq", "show", "0a4f")
    assert ambiguous.returncode == 2, ambiguous.stderr
    assert ambiguous.stderr == (
        "error: AmbiguousId: 2 dead letters have an event id starting '0a4f' "
        f"({ids[0]}, {ids[1]}): give more of it\n"
    )
    several = cli("dlq", "show", "0a4f2")  # one event id, dead for two consumers
    assert several.returncode == 2, several.stderr
    assert "is a dead letter of several consumers (billing, shipping): give one with -c" in (
        several.stderr
    )
    chosen = cli("dlq", "show", "0a4f2", "-c", "billing")
    assert chosen.returncode == 0 and "consumer: billing" in chosen.stdout, chosen.stderr

    # A prefix acts as the whole id: purging one consumer's copy leaves the other's.
    purged = cli("dlq", "purge", "0a4f2", "-c", "shipping")
    assert purged.returncode == 0 and purged.stderr == "purged 1 dead letter\n", purged.stderr
    listed = cli("dlq", "list").stdout
    assert listed.count(ids[1]) == 1 and "billing" in listed
    missing = cli("dlq", "purge", "0b")
    assert missing.returncode == 1
    assert missing.stderr == "error: DeadLetterNotFound: no dead letter with id '0b'\n"


def test_old_duration_options_still_work_and_say_what_to_write(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    cli = Cli(settings)
    add_dead_letter(acceptance_engine, settings, "c1", str(uuid.uuid4()))
    old = cli("dlq", "list", "--older-than-hours", "720")
    new = cli("dlq", "list", "--older-than", "30d")
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout
    assert (
        old.stderr == "--older-than-hours is deprecated: write --older-than 30d\n0 dead letters\n"
    )
    doctor = cli("doctor", "--no-kafka", "--json", "--idle-seconds", "90")
    assert "--idle-seconds is deprecated: write --idle-longer-than 90s" in doctor.stderr
    assert doctor.returncode in (0, 1), doctor.stderr


def test_failed_retry_keeps_the_event_id_in_a_new_row_as_documented(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    engine, cli = acceptance_engine, Cli(settings)
    tables = build_tables(settings)
    topic = f"retry-{uuid.uuid4().hex[:6]}"
    publish(engine, settings, topic, 2)
    with engine.connect() as conn:
        before = dict(conn.execute(select(tables.events.c.event_id, tables.events.c.id)).all())
    move_to_failed(engine, settings, topic, 2)
    retried = cli("failed", "retry", "--all")
    assert retried.returncode == 0 and retried.stdout == "requeued 2 rows\n", retried.stderr
    with engine.connect() as conn:
        after = dict(conn.execute(select(tables.events.c.event_id, tables.events.c.id)).all())
    assert set(after) == set(before)  # the same event ids: consumers still deduplicate them
    assert all(after[e] > max(before.values()) for e in after)  # new rows, at the lanes' heads

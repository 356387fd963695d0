"""The ``outbox`` CLI as a new user meets it: bad input and unreachable services give one
clear line and a non-zero exit (never a traceback), destructive purges ask first, unknown
ids say so, ``--version``/``-h``, global options after the sub-command, and JSON logs that
are one JSON object per line."""

from __future__ import annotations

import json
import os
import pty
import re
import socket
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.acceptance.conftest import ROOT, Cli, SchemaFactory
from tests.acceptance.test_lag_cli import move_to_failed, publish

pytestmark = pytest.mark.acceptance

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(scope="module")
def cli(fresh_schema: SchemaFactory) -> Cli:
    return Cli(fresh_schema())


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_dead_letter(engine: Engine, settings: OutboxSettings, consumer: str, event_id: str) -> None:
    t = build_tables(settings).dead_letters
    with engine.begin() as conn:
        conn.execute(
            insert(t).values(
                consumer=consumer,
                event_id=event_id,
                topic="shop.orders",
                partition=0,
                offset=7,
                event_type="order.created",
                key=b"k",
                value=b"{}",
                header_names=[],
                header_values=[],
                error_class="ValueError",
                error_message="bad",
                attempts=3,
                dlq_topic="shop.orders.dlq",
            )
        )


def count(engine: Engine, settings: OutboxSettings, table: str) -> int:
    t = getattr(build_tables(settings), table)
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t)).scalar_one())


@pytest.mark.parametrize(
    ("args", "rc", "says"),
    [
        (["dlq", "list", "--limit", "-5"], 2, "--limit"),
        (["--log-level", "banana", "status"], 2, "'banana' is not one of"),
        (["relay", "--log-level", "banana"], 2, "'banana' is not one of"),
        (["db", "upgrade", "9999"], 2, "Can't locate revision identified by '9999'"),
        (["db", "sql", "9999"], 2, "Can't locate revision identified by '9999'"),
        (["lag", "--max-pending", "-1"], 2, "--max-pending"),
        (["lag", "--max-age", "-1"], 2, "--max-age"),
        (["lag", "--stale-after", "-3"], 2, "'-3' is not a duration like 90s, 30m, 12h or 30d"),
        (["lag", "--stale-after", "0"], 2, "'0' is not a duration above 0s"),
        (["lag", "--interval", "5x"], 2, "'5x' is not a duration like 90s, 30m, 12h or 30d"),
        (["cleanup", "--inbox-older-than", "3x"], 2, "'3x' is not a duration like"),
        (["dlq", "purge", "--older-than-hours", "-1", "--all", "--yes"], 2, "--older-than-hours"),
        (["failed", "purge", "--older-than-hours", "-1", "--yes"], 2, "--older-than-hours"),
        (["failed", "retry", "999999"], 1, "error: NotFound: no failed row with id 999999"),
        (
            ["failed", "purge", "999998", "999999"],
            1,
            "NotFound: no failed row with id 999998, 999999",
        ),
        (
            ["dlq", "show", "nope", "--consumer", "c"],
            1,
            "error: DeadLetterNotFound: no dead letter with id 'nope' for consumer 'c'",
        ),
        (["dlq", "purge", "nope"], 1, "error: DeadLetterNotFound: no dead letter with id 'nope'"),
        (["dlq", "replay", "nope"], 1, "error: DeadLetterNotFound: no dead letter with id 'nope'"),
        (["dlq", "replay"], 2, "error: UsageError: give an EVENT_ID, a filter, or --all"),
        (["failed", "retry"], 2, "error: UsageError: give the ids to retry, or --all"),
        (["dlq", "list", "--no-such-flag"], 2, "error: NoSuchOption: No such option: --no-such"),
        (["consume", "no_such_module:app"], 2, "cannot import 'no_such_module'"),
    ],
)
def test_bad_input_exits_non_zero_with_a_clear_line_and_no_traceback(
    cli: Cli, args: list[str], rc: int, says: str
) -> None:
    proc = cli(*args)
    output = _output(proc)
    assert proc.returncode == rc, output
    assert "Traceback" not in output
    assert says in " ".join(output.split()), output  # Rich may wrap a long line
    assert "requeued" not in output and "purged" not in output


def test_dlq_replay_with_kafka_down_is_one_line_and_debug_shows_the_traceback(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    add_dead_letter(acceptance_engine, settings, "c1", "e1")
    kafka = f"127.0.0.1:{_closed_port()}"
    down = Cli(settings, (("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", kafka),))
    proc = down("dlq", "replay", "--all")
    assert proc.returncode == 1, _output(proc)
    assert "Traceback" not in _output(proc)
    # aiokafka's own ERROR line may come first; the command ends with one line of its own.
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: BrokerUnavailable: Kafka unreachable at {kafka}: KafkaConnectionError"

    debug = down("dlq", "replay", "--all", "--log-level", "debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "BrokerUnavailable" in debug.stderr


def test_purges_refuse_without_yes_when_no_terminal_can_ask(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    cli = Cli(settings)
    engine = acceptance_engine
    add_dead_letter(engine, settings, "c1", "e1")
    add_dead_letter(engine, settings, "c1", "e2")
    publish(engine, settings, "absent-topic", 2)
    move_to_failed(engine, settings, "absent-topic", 2)

    for args in (
        ["dlq", "purge", "--all"],
        ["dlq", "purge", "--consumer", "c1"],
        ["failed", "purge", "--all"],
        ["failed", "purge", "--older-than", "0s"],
    ):
        proc = cli(*args)
        assert proc.returncode == 2, _output(proc)
        assert proc.stderr.startswith("error: UsageError: refusing to"), proc.stderr
        assert "without --yes" in proc.stderr
        assert "Traceback" not in _output(proc)
    assert count(engine, settings, "dead_letters") == 2
    assert count(engine, settings, "failed") == 2

    # One named event needs no confirmation; the bulk purges go through with --yes.
    one = cli("dlq", "purge", "e1")
    assert one.returncode == 0 and "purged 1 dead letter\n" in one.stderr
    rest = cli("dlq", "purge", "--all", "--yes")
    assert rest.returncode == 0 and "purged 1 dead letter\n" in rest.stderr
    failed = cli("failed", "purge", "--all", "-y")
    assert failed.returncode == 0 and "purged 2 rows" in failed.stdout
    assert count(engine, settings, "dead_letters") == count(engine, settings, "failed") == 0


def test_purge_asks_on_a_terminal_and_does_nothing_unless_confirmed(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    settings = fresh_schema()
    cli = Cli(settings)
    add_dead_letter(acceptance_engine, settings, "c1", "e1")

    def answer(reply: str) -> tuple[int, str]:
        controller, terminal = pty.openpty()
        try:
            proc = subprocess.Popen(
                cli.command("dlq", "purge", "--all"),
                cwd=ROOT,
                env=cli.env,
                stdin=terminal,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            os.write(controller, reply.encode())
            out, err = proc.communicate(timeout=60)
        finally:
            os.close(controller)
            os.close(terminal)
        return proc.returncode, out + err

    rc, output = answer("n\n")
    assert rc == 1 and "Purge every dead letter?" in output and "nothing done" in output
    assert count(acceptance_engine, settings, "dead_letters") == 1
    rc, output = answer("y\n")
    assert rc == 0 and "purged 1 dead letter" in output, output
    assert count(acceptance_engine, settings, "dead_letters") == 0


def test_version_and_short_help_everywhere(cli: Cli) -> None:
    version = cli("--version")
    assert version.returncode == 0
    assert re.fullmatch(r"outbox-inbox \d+\.\d+\.\d+\S*\n", version.stdout), version.stdout
    for args in (["-h"], ["relay", "-h"], ["dlq", "list", "-h"], ["failed", "purge", "-h"]):
        proc = cli(*args)
        assert proc.returncode == 0, _output(proc)
        assert "Usage: outbox" in proc.stdout and "--help" in proc.stdout


def test_global_options_are_accepted_after_the_sub_command(cli: Cli) -> None:
    # The acceptance environment sets OUTBOX_LOG_LEVEL=WARNING; Alembic's lines appear only
    # if the --log-level written after `upgrade` was applied (they are DEBUG-only).
    quiet = cli("db", "upgrade")
    assert "Will assume transactional DDL" not in quiet.stderr
    loud = cli("db", "upgrade", "--log-level", "debug")
    assert loud.returncode == 0, loud.stderr
    assert "Will assume transactional DDL" in loud.stderr

    as_json = cli("db", "upgrade", "--json-logs", "--log-level=info")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stderr.splitlines()[0])["msg"].startswith("migrating")


def test_env_file_adds_settings_and_the_environment_wins(cli: Cli, tmp_path: Path) -> None:
    env_file = tmp_path / "outbox.env"
    env_file.write_text("OUTBOX_TABLE_PREFIX=fromfile_\nOUTBOX_DB_SCHEMA=not_this_one\n")
    proc = cli("config", "show", "--env-file", str(env_file))
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["table_prefix"] == "fromfile_"
    assert shown["db_schema"] == cli.settings.db_schema  # OUTBOX_DB_SCHEMA is set in the env

    missing = cli("--env-file", str(tmp_path / "absent.env"), "config", "show")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert "Traceback" not in _output(missing)


def test_json_logs_are_one_object_per_line_with_utc_millisecond_timestamps(cli: Cli) -> None:
    proc = cli("--json-logs", "--log-level", "debug", "db", "upgrade")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert len(lines) >= 3  # the notice, alembic's lines (at debug), the result
    assert any(line["logger"].startswith("alembic") for line in lines)
    for line in lines:
        assert TIMESTAMP.match(line["ts"]), line
        assert {"level", "logger", "msg"} <= set(line)
    done = lines[-1]
    assert done["msg"] == f"at revision {done['revision']}" and done["logger"] == "outbox.cli"

    failed = cli("--json-logs", "db", "upgrade", "9999")
    assert failed.returncode == 2
    *_, error = [json.loads(line) for line in failed.stderr.splitlines()]
    assert error["level"] == "error" and "9999" in error["msg"]
    assert "Traceback" not in failed.stderr

    # A usage error is a JSON record too, not a Rich panel.
    usage = cli("dlq", "list", "--limit", "-5", "--json-logs")
    assert usage.returncode == 2
    [line] = [json.loads(line) for line in usage.stderr.splitlines()]
    assert line["level"] == "error" and "'--limit'" in line["msg"]


def test_human_logs_carry_the_same_timestamps(cli: Cli) -> None:
    proc = cli("db", "upgrade", "--log-level", "debug")
    stamped = [line for line in proc.stderr.splitlines() if "alembic" in line]
    assert stamped
    assert all(TIMESTAMP.match(line.split(" ", 1)[0]) for line in stamped), stamped


def test_commands_print_no_alembic_line_at_the_default_level(cli: Cli) -> None:
    """Alembic's INFO chatter ("Context impl PostgresqlImpl.", "Will assume transactional
    DDL.") is shown at --log-level debug only; `db upgrade` names what it applied itself."""
    fresh = Cli(cli.settings.model_copy(update={"db_schema": f"quiet_{os.getpid()}"}))
    env = {k: v for k, v in fresh.env.items() if k != "OUTBOX_LOG_LEVEL"}  # the default: INFO

    def outbox(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            fresh.command(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    def alembic_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
        return [
            line
            for line in _output(proc).splitlines()
            if "alembic" in line or "PostgresqlImpl" in line or "transactional DDL" in line
        ]

    upgrade = outbox("db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    assert alembic_lines(upgrade) == []
    assert "applied 0001: The outbox events table." in upgrade.stderr

    for args in (("status",), ("db", "current"), ("db", "upgrade")):
        proc = outbox(*args)
        assert proc.returncode == 0, _output(proc)
        assert alembic_lines(proc) == [], args
    status = outbox("status")
    assert status.stdout.startswith("database ") and status.stderr == ""

    debug = outbox("status", "--log-level", "debug")
    assert any("Context impl PostgresqlImpl." in line for line in alembic_lines(debug))

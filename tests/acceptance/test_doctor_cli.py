"""`outbox doctor` / `outbox status` as subprocesses against deliberately broken setups."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, func, insert, text
from sqlalchemy.engine import make_url

from outbox import Outbox
from outbox.envelope import Message
from outbox.ops.record_limits import header_room
from outbox.tables import build_tables
from tests.acceptance.conftest import Cli, SchemaFactory
from tests.support.kafka import create_topic

pytestmark = pytest.mark.acceptance


def findings(report: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return [f for f in report if f["check"] == check]


def test_doctor_flags_a_dropped_claim_index_and_its_fix_works(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    s = fresh_schema()
    cli = Cli(s)
    claim = f"{s.table_prefix}events_claim_idx"
    healthy = cli.json("doctor", "--no-kafka")  # only a warning: no relay runs
    assert [f["level"] for f in findings(healthy, "index")] == ["ok"]

    with acceptance_engine.begin() as conn:
        conn.execute(text(f'DROP INDEX "{s.db_schema}"."{claim}"'))
    broken = cli.json("doctor", "--no-kafka", expect_rc=1)
    [finding] = findings(broken, "index")
    assert finding["level"] == "error"
    assert finding["details"]["index"] == claim
    assert "CREATE INDEX CONCURRENTLY" in finding["action"]

    # The advice is runnable as given (CONCURRENTLY needs autocommit).
    ddl = finding["action"].removeprefix("create it: ")
    with acceptance_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(ddl))
    fixed = cli.json("doctor", "--no-kafka")
    assert [f["level"] for f in findings(fixed, "index")] == ["ok"]
    # Warnings alone pass, unless --strict.
    assert cli("doctor", "--no-kafka", "--strict").returncode == 2


def test_doctor_flags_an_idle_in_transaction_session(fresh_schema: SchemaFactory) -> None:
    s = fresh_schema()
    cli = Cli(s)
    with psycopg.connect(s.libpq_dsn) as idle:
        idle.execute("SELECT txid_current()")  # opens a transaction and takes an xid
        pid = idle.info.backend_pid
        time.sleep(1.5)
        report = cli.json("doctor", "--no-kafka", "--idle-longer-than", "1s", expect_rc=1)
        mine = [f for f in findings(report, "idle_in_transaction") if f["details"]["pid"] == pid]
        assert len(mine) == 1
        assert mine[0]["level"] == "error"
        assert mine[0]["details"]["holds_horizon"] is True
        assert f"pg_terminate_backend({pid})" in mine[0]["action"]
        idle.rollback()
    report = cli.json("doctor", "--no-kafka", "--idle-longer-than", "1s")
    assert not [f for f in findings(report, "idle_in_transaction") if f["level"] != "ok"]


def test_doctor_status_and_lag_name_a_held_snapshot_and_an_open_outbox_writer(
    fresh_schema: SchemaFactory,
) -> None:
    """A report running in REPEATABLE READ (state "active", like pg_dump) holds back VACUUM
    while the outbox gathers dead rows, and a producer's transaction stays open after its
    INSERT. doctor, status and lag name both, never the report's literal."""
    s = fresh_schema()
    cli = Cli(s)
    events = f'"{s.db_schema}"."{s.table_prefix}events"'
    insert = (
        f"INSERT INTO {events} (event_id, topic, lane, event_type, source, content_type,"
        " payload, fingerprint) SELECT gen_random_uuid(), 't', g %% 8, 'e', 's', 'c', '', ''"
        " FROM generate_series(1, %s) g"
    )
    with psycopg.connect(s.libpq_dsn, application_name="nightly-report") as held:
        held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        held.execute("SELECT txid_current()")
        running = threading.Thread(
            target=lambda: held.execute("SELECT pg_sleep(12), 'secret-literal' AS label")
        )
        running.start()
        with psycopg.connect(s.libpq_dsn) as conn:  # closing it flushes its statistics
            conn.execute(insert, (300,))
            conn.commit()
            conn.execute(f"DELETE FROM {events}")  # as a relay would, after publishing
            conn.commit()
        with psycopg.connect(s.libpq_dsn, application_name="forgetful-producer") as writer:
            writer.execute(insert, (1,))  # and the transaction stays open
            time.sleep(2)
            report = cli.json("doctor", "--no-kafka", "--snapshot-older-than", "1s", expect_rc=1)
            status = cli.json("status", "--snapshot-older-than", "1s", expect_rc=1)
            lag = cli.json("lag", "--no-kafka")
            plain = cli("status", "--snapshot-older-than", "1s").stdout
            writer_pid = writer.info.backend_pid
            writer.rollback()
        running.join()
        held.rollback()
        held_pid = held.info.backend_pid
    [snapshot] = findings(report, "snapshot")
    assert snapshot["level"] == "warn"  # 300 dead rows: below the error threshold
    holder = snapshot["details"]["holder"]
    assert (holder["pid"], holder["name"], holder["state"]) == (
        held_pid,
        "nightly-report",
        "active",
    )
    assert holder["query"] == "SELECT pg_sleep(12), '…' AS label"
    assert holder["seconds"] > 1
    assert snapshot["details"]["outbox_dead_rows"] >= 300
    assert f"pg_terminate_backend({held_pid})" in snapshot["action"]
    [writer_finding] = findings(report, "outbox_writer")
    assert writer_finding["level"] == "error"
    assert writer_finding["details"]["pid"] == writer_pid
    assert "forgetful-producer" in writer_finding["what"]
    assert status["vacuum"]["oldest_snapshot"]["pid"] == held_pid
    assert {p["check"] for p in status["problems"]} >= {"snapshot", "outbox_writer"}
    assert lag["vacuum"]["outbox_dead_rows"] >= 300
    assert lag["totals"]["oldest_snapshot_seconds"] > 1
    assert "nightly-report" in plain and "dead tuples (not yet vacuumed)" in plain
    for out in (report, status, lag, plain):
        assert "secret-literal" not in str(out)


async def test_doctor_checks_topics_and_relays(
    fresh_schema: SchemaFactory,
    acceptance_engine: Engine,
    new_topic: Callable[..., Awaitable[str]],
) -> None:
    s = fresh_schema(lanes=8)
    present = await new_topic(partitions=3)
    absent = f"absent-{uuid.uuid4().hex[:8]}"
    t = build_tables(s)
    with acceptance_engine.begin() as conn:
        Outbox(s).publish(conn, topic=absent, payload={"x": 1}, event_type="t.x", key="k")
        conn.execute(
            insert(t.relays).values(relay_id="r-live", hostname="h1", pid=1, lanes=[0, 1, 2, 3])
        )
        conn.execute(
            insert(t.relays).values(
                relay_id="r-gone", hostname="h2", pid=2, lanes=[4, 5, 6, 7],
                heartbeat_at=func.now() - text("interval '5 minutes'"),
            )
        )  # fmt: skip
    report = Cli(s).json("doctor", "--topic", f"{present}:4", expect_rc=1)
    topics = {f["details"]["topic"]: f for f in findings(report, "topic")}
    assert topics[absent]["level"] == "error"  # pending rows for a topic Kafka lacks
    assert f"outbox topics ensure --topic {absent}" in topics[absent]["action"]
    assert "--replication-factor" not in topics[absent]["action"]
    assert topics[present]["level"] == "warn"
    assert topics[present]["details"] == {"topic": present, "partitions": 3, "expected": 4}
    relays = findings(report, "relays")
    assert any(f["details"].get("relay_id") == "r-gone" for f in relays), relays
    assert any(f["details"].get("unowned") == [4, 5, 6, 7] for f in relays)

    # A generous window: on a loaded machine the CLIs above can take longer than the
    # default (five heartbeats); the test is about a 5-minute-old heartbeat.
    lag = Cli(s).json("lag", "--no-kafka", "--stale-after", "120")
    alive = {r["relay_id"]: r["alive"] for r in lag["relays"]}
    assert alive == {"r-live": True, "r-gone": False}
    assert lag["totals"]["unowned_lanes"] == 4

    status = Cli(s).json("status", "--topic", present, expect_rc=1)
    assert status["totals"]["pending"] == 1
    assert {p["check"] for p in status["problems"]} >= {"topic", "relays"}


def test_doctor_reports_a_database_it_cannot_reach(fresh_schema: SchemaFactory) -> None:
    s = fresh_schema()
    url = make_url(s.database_url.get_secret_value())
    missing_db = url.set(database=f"{url.database}_missing").render_as_string(hide_password=False)
    report = Cli(s.model_copy(update={"database_url": SecretStr(missing_db)})).json(
        "doctor", "--no-kafka", expect_rc=1
    )
    [finding] = findings(report, "database")
    assert finding["level"] == "error"
    assert "SQLSTATE 3D000" in finding["what"] and "does not exist" in finding["what"]
    assert ":outbox@" not in str(report)  # the password never leaks


def test_status_summarises(fresh_schema: SchemaFactory, acceptance_engine: Engine) -> None:
    s = fresh_schema()
    with acceptance_engine.begin() as conn:
        Outbox(s).publish_many(
            conn, [Message(topic="t-status", payload={}, event_type="t.s") for _ in range(3)]
        )
    proc = Cli(s)("status")
    assert proc.returncode == 1, proc.stderr  # pending rows but no relay; topic missing
    assert "3 pending" in proc.stdout
    assert "no live relay" in proc.stdout


async def test_doctor_flags_a_dead_letter_topic_taking_smaller_records_than_its_source(
    fresh_schema: SchemaFactory, acceptance_engine: Engine, kafka_bootstrap: str
) -> None:
    s = fresh_schema()
    # A consumer reads `big` (its attempt marker says so): its dead-letter topic takes 1 MB,
    # the source 3 MB. `small` (named on the command line) has a roomy dead-letter topic.
    big = await create_topic(kafka_bootstrap, configs={"max.message.bytes": "3000000"})
    await create_topic(kafka_bootstrap, big + ".dlq", configs={"max.message.bytes": "1000000"})
    small = await create_topic(kafka_bootstrap, configs={"max.message.bytes": "500000"})
    await create_topic(kafka_bootstrap, small + ".dlq")
    t = build_tables(s)
    with acceptance_engine.begin() as conn:
        conn.execute(
            insert(t.inbox_attempts).values(
                consumer="billing", topic=big, partition=0, start_offset=0, end_offset=0,
                attempts=0,
            )
        )  # fmt: skip
    report = Cli(s).json("doctor", "--topic", small)
    [finding] = findings(report, "dead_letter_topic")
    assert finding["level"] == "warn"
    assert finding["details"] == {
        "topic": big + ".dlq",
        "max_message_bytes": 1_000_000,
        "source": big,
        "source_max_message_bytes": 3_000_000,
    }
    room = header_room(s.consumer.error_message_chars)
    assert (
        f"--entity-name {big}.dlq --add-config max.message.bytes={3_000_000 + room}"
        in (finding["action"])
    )


async def test_doctor_asks_for_group_instance_ids_in_a_group_of_dynamic_members(
    fresh_schema: SchemaFactory,
    acceptance_engine: Engine,
    new_topic: Callable[..., Awaitable[str]],
) -> None:
    # Issue 52: with dynamic members a group coordinator that hangs and comes back (and
    # every restart) stops all of the group's partitions; static members keep theirs.
    from aiokafka import AIOKafkaConsumer

    s = fresh_schema()
    topic = await new_topic(partitions=2)
    dynamic, static = f"c-{uuid.uuid4().hex[:8]}", f"c-{uuid.uuid4().hex[:8]}"
    inbox = build_tables(s).inbox
    with acceptance_engine.begin() as conn:  # the inbox knows both consumers
        for group in (dynamic, static):
            conn.execute(
                insert(inbox).values(
                    consumer=group, event_id="e", topic=topic, partition=0, offset=0,
                    status="processed",
                )
            )  # fmt: skip
    members = [
        AIOKafkaConsumer(
            topic,
            bootstrap_servers=s.kafka_bootstrap_servers,
            group_id=group,
            group_instance_id=f"{group}-{n}" if group == static else None,
            enable_auto_commit=False,
        )
        for group in (dynamic, static)
        for n in range(2)
    ]
    try:
        for member in members:
            await member.start()
        # Both groups formed (each member took part in a join).
        await asyncio.gather(*(m.getmany(timeout_ms=3000) for m in members))
        report = await asyncio.to_thread(Cli(s).json, "doctor")
    finally:
        for member in members:
            await member.stop()
    groups = {f["details"]["group"]: f for f in findings(report, "consumer group")}
    assert groups[dynamic]["level"] == "warn", groups
    assert groups[dynamic]["details"] == {"group": dynamic, "members": 2, "dynamic": 2}
    assert "OUTBOX_CONSUMER__GROUP_INSTANCE_ID" in groups[dynamic]["action"]
    assert "{hostname}" in groups[dynamic]["action"]
    assert groups[static]["level"] == "ok", groups

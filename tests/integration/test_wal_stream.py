"""The WAL source's streaming replication connection (relay/sources/wal/stream.py) on real
PostgreSQL and Kafka, the relay and the consumer as CLI subprocesses: the server ending
the walsender under the relay loses nothing and the inbox applies each event once, in
order; a standby takes over a SIGKILLed reader's slot; the stream works over a TLS URL;
what cannot stream (a role without REPLICATION, a pooler in front) stops the relay with
exit 2 and one line. (The idle slot's keepalives: test_wal_source.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from outbox.settings import OutboxSettings
from tests.support.inbox import effect_rows, effects_table, subprocess_env
from tests.support.pgbouncer import PgBouncer
from tests.support.relay import RelayProcess, outbox_cli, publish_numbered, read_ids, verdict
from tests.support.services import Secured
from tests.support.wal import (
    login_role,
    slot_reader,
    wait_until,
    wal_relay_env,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INBOX_APP = "tests.support.inbox_apps:app"


@pytest.fixture
def settings(wal_settings: OutboxSettings) -> OutboxSettings:
    return wal_settings


def _exit_line(relay: RelayProcess) -> str:
    """The one error line of a relay that stopped with exit 2, no traceback."""
    try:
        code = relay.proc.wait(60)
    finally:
        relay.kill()
    log = relay.log()
    [line] = [x for x in log.splitlines() if x.startswith("error:")]
    assert code == 2, log[-3000:]
    assert "Traceback" not in log
    return line


def _consumer(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``outbox consume`` of the test inbox app (its effects table counts applications)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("outbox")), "consume", INBOX_APP],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


async def test_the_walsender_ended_mid_stream_loses_nothing_and_the_inbox_applies_each_once(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=6)
    table = effects_table(engine)
    relay = RelayProcess(wal_relay_env(settings, OUTBOX_RELAY__BATCH_SIZE="200"), tmp_path, "relay")
    consumer_env = subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=f"walstream-{uuid.uuid4().hex[:8]}",
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
    )
    consumer = _consumer(consumer_env, tmp_path / "consumer.log")
    ids: list[str] = []
    kills = 0

    def produce() -> None:
        # Until 6 walsenders have been ended mid-stream (at least 10,000 events).
        chunk = 0
        while chunk < 400 and (chunk < 100 or kills < 6):
            ids.extend(
                publish_numbered(
                    engine,
                    settings,
                    topic,
                    100,
                    keys=40,
                    start=chunk * 100,
                    event_type="test.event",
                )
            )
            time.sleep(0.05)
            chunk += 1

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        while producer.is_alive():
            await asyncio.sleep(1.0)
            pid = await asyncio.to_thread(slot_reader, settings)
            if pid is None:
                continue
            with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", [pid])
            kills += 1
        producer.join()
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids, 120)

        def applied() -> bool:
            with engine.connect() as conn:
                n = conn.execute(text(f"SELECT count(DISTINCT event_id) FROM {table}"))
                return int(n.scalar_one()) >= len(ids)

        done = await asyncio.to_thread(wait_until, applied, 120)
        assert done, (tmp_path / "consumer.log").read_text()[-3000:]
        assert relay.alive(), relay.log()[-3000:]
        code, _ = relay.terminate()
    finally:
        relay.kill()
        consumer.terminate()
        consumer.wait(30)
    rows = effect_rows(engine, table)
    seen: dict[str, int] = {}
    last: dict[str, int] = {}
    out_of_order = 0
    for event_id, key, seq in rows:
        seen[event_id] = seen.get(event_id, 0) + 1
        assert key is not None and seq is not None
        if seq < last.get(key, -1):
            out_of_order += 1
        last[key] = max(seq, last.get(key, -1))
    lost = len(set(ids) - set(seen))
    duplicate_effects = sum(n - 1 for n in seen.values())
    v = verdict(records, ids)
    print(
        f"walsender ended {kills} times: {len(ids)} events, {v.duplicates} duplicates on "
        f"Kafka, effects: lost {lost}, duplicates {duplicate_effects}, out of order "
        f"{out_of_order}"
    )
    assert kills >= 6 and len(ids) >= 10_000
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert (lost, duplicate_effects, out_of_order) == (0, 0, 0)
    assert relay.log().count("reading the slot") > kills // 2  # it came back each time
    assert code == 0 and "Traceback" not in relay.log()


async def test_a_standby_streams_the_slot_once_the_reader_is_sigkilled(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=2)
    env = wal_relay_env(settings, OUTBOX_RELAY__POLL_INTERVAL_SECONDS="0.2")
    first = RelayProcess(env, tmp_path, "first")
    assert await asyncio.to_thread(wait_until, lambda: "reading the slot" in first.log(), 30)
    second = RelayProcess(env, tmp_path, "second")
    try:
        before = publish_numbered(engine, settings, topic, 200, keys=10)
        await read_ids(settings.kafka_bootstrap_servers, topic, before)
        reader = await asyncio.to_thread(slot_reader, settings)
        first.kill()
        # The standby streams the slot: the slot's session is a new one.
        took = await asyncio.to_thread(
            wait_until, lambda: slot_reader(settings) not in (None, reader), 30
        )
        assert took, second.log()[-3000:]
        after = publish_numbered(engine, settings, topic, 200, keys=10, start=200)
        records = await read_ids(settings.kafka_bootstrap_servers, topic, before + after)
        assert "reading the slot" in second.log()
    finally:
        first.kill()
        second.kill()
    v = verdict(records, before + after)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v


async def test_the_stream_runs_over_a_tls_url(
    engine: Engine,
    settings: OutboxSettings,
    secured: Secured,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    # The test database, reached with the TLS URL's settings (verify-full against the CA).
    tls = make_url(secured.pg_tls_url)
    url = make_url(settings.database_url.get_secret_value()).set(query=tls.query)
    own = settings.model_copy(
        update={"database_url": SecretStr(url.render_as_string(hide_password=False))}
    )
    relay = RelayProcess(wal_relay_env(own), tmp_path, "tls")
    try:
        ids = publish_numbered(engine, settings, topic, 100)
        records = await read_ids(settings.kafka_bootstrap_servers, topic, ids)
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_replication_slots r"
                " ON r.active_pid = s.pid WHERE r.slot_name = %s",
                [settings.wal.slot],
            ).fetchone()
    finally:
        relay.kill()
    v = verdict(records, ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert row == (True,), relay.log()[-3000:]


@pytest.fixture
def no_replication(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    with login_role(settings) as own:
        yield own


def test_a_role_without_replication_exits_2_with_the_sql_to_run(
    settings: OutboxSettings, no_replication: OutboxSettings, tmp_path: Path
) -> None:
    role = make_url(no_replication.database_url.get_secret_value()).username
    env = wal_relay_env(no_replication)
    # Not yet a member of the relay's job role: refused the tables, told where the grants are.
    line = _exit_line(RelayProcess(env, tmp_path, "nogrants"))
    assert "PrivilegeMissing" in line and "permission denied" in line, line
    assert "outbox db sql --roles" in line, line
    # Its tables granted, still without REPLICATION: the SQL that gives it.
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}"
            ).format(psycopg.sql.Identifier(settings.db_schema), psycopg.sql.Identifier(role))
        )
    line = _exit_line(RelayProcess(env, tmp_path, "norepl"))
    assert "WalPrivilegeMissing" in line and "REPLICATION" in line
    assert f'ALTER ROLE "{role}" WITH REPLICATION;' in line


def test_through_a_pooler_the_relay_exits_2_saying_it_needs_a_direct_connection(
    settings: OutboxSettings, pgbouncers: Callable[[str, int], PgBouncer], tmp_path: Path
) -> None:
    bouncer = pgbouncers("session", 2)
    url = bouncer.url(settings.database_url.get_secret_value())
    env = wal_relay_env(settings, OUTBOX_DATABASE_URL=url)
    line = _exit_line(RelayProcess(env, tmp_path, "pooled"))
    assert "ReplicationRefused" in line and "directly" in line
    # `outbox doctor` says so before any relay starts.
    doctor = outbox_cli("doctor", "--no-kafka", "--json", env=env)
    found = {f["check"]: f for f in json.loads(doctor.stdout)}
    assert doctor.returncode == 1, doctor.stderr
    assert found["wal_stream"]["level"] == "error", found["wal_stream"]
    assert "OUTBOX_RELAY__DATABASE_URL" in found["wal_stream"]["action"]
    direct = outbox_cli("doctor", "--no-kafka", "--json", env=wal_relay_env(settings))
    found = {f["check"]: f for f in json.loads(direct.stdout)}
    assert found["wal_stream"]["level"] == "ok", found["wal_stream"]

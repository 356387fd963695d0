"""Least-privilege roles (`outbox db sql --roles`): each daemon and tool runs as a login
user in its job's role and does its whole job — producer -> relay -> consumer (with a dead
letter) -> lag/doctor/cleanup — while what a job must not do is refused by PostgreSQL with
SQLSTATE 42501 (insufficient_privilege)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from aiokafka.admin import NewTopic
from pydantic import SecretStr
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from outbox import Message, Outbox, migrate
from outbox.db import sync_engine
from outbox.kafka.clients import kafka_admin
from outbox.roles import JOBS, role_names
from outbox.settings import OutboxSettings
from tests.security.conftest import Daemon, cli, run_daemon, secret, until
from tests.support.console import console_process, seed_dead_letters

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Jobs:
    owner: OutboxSettings  # the tables' owner (migrations)
    as_job: dict[str, OutboxSettings]  # job -> settings logging in as a member of its role
    logins: dict[str, str]  # job -> login user name

    @property
    def events(self) -> str:
        return f'"{self.owner.db_schema}"."{self.owner.table_prefix}events"'


def _owner_dsn(settings: OutboxSettings) -> str:
    return settings.libpq_dsn


@pytest.fixture
def jobs(base_settings: OutboxSettings) -> Iterator[Jobs]:
    owner = base_settings.model_copy(update={"table_prefix": f"g{uuid.uuid4().hex[:8]}_"})
    migrate.upgrade(owner)
    role_prefix = f"r{uuid.uuid4().hex[:8]}_"
    proc = cli(owner, "db", "sql", "--roles", "--role-prefix", role_prefix)
    assert proc.returncode == 0, proc.stderr
    groups = role_names(role_prefix)
    logins = {job: f"{groups[job]}_login" for job in JOBS}
    passwords = {job: secret(f"pw-{job}-{uuid.uuid4().hex[:10]}") for job in JOBS}
    with psycopg.connect(_owner_dsn(owner), autocommit=True) as conn:
        conn.execute(proc.stdout)  # the script exactly as the CLI printed it
        conn.execute(proc.stdout)  # and it can be applied again
        for job in JOBS:
            conn.execute(
                psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    psycopg.sql.Identifier(logins[job]),
                    psycopg.sql.Literal(passwords[job]),
                    psycopg.sql.Identifier(groups[job]),
                )
            )
    url = make_url(owner.database_url.get_secret_value())
    as_job = {
        job: owner.model_copy(
            update={
                "database_url": SecretStr(
                    url.set(username=logins[job], password=passwords[job]).render_as_string(
                        hide_password=False
                    )
                )
            }
        )
        for job in JOBS
    }
    yield Jobs(owner, as_job, logins)
    with psycopg.connect(_owner_dsn(owner), autocommit=True) as conn:
        for name in [*logins.values(), *groups.values()]:
            ident = psycopg.sql.Identifier(name)
            conn.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(ident))
            conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(ident))


def refused(settings: OutboxSettings, statement: str) -> str:
    """Run ``statement`` as ``settings``' user; the SQLSTATE PostgreSQL refused it with."""
    with psycopg.connect(settings.libpq_dsn) as conn:
        try:
            conn.execute(statement)
        except psycopg.Error as exc:
            return str(exc.sqlstate)
    return "allowed"


def test_the_producer_publishes_and_can_do_nothing_else_to_the_outbox(jobs: Jobs) -> None:
    producer = jobs.as_job["producer"]
    engine = sync_engine(producer)
    ob = Outbox(producer)
    event_id = uuid.uuid4()
    try:
        for _ in range(2):  # the second publish of the same event_id is a no-op
            with engine.begin() as conn:
                ob.publish(conn, topic="t", event_type="e", payload={"a": 1}, event_id=event_id)
    finally:
        engine.dispose()
    with psycopg.connect(jobs.owner.libpq_dsn) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {jobs.events}").fetchone()
    assert rows == (1,)
    assert refused(producer, f"DELETE FROM {jobs.events}") == "42501"
    assert refused(producer, f"UPDATE {jobs.events} SET attempts = 9") == "42501"
    assert refused(producer, f"SELECT published_at FROM {jobs.events}") == "42501"


def test_the_relay_reads_its_claim_horizon_and_the_vacuum_figures(jobs: Jobs) -> None:
    """The statements of relay/sources/table/horizon.py, as the relay's role: the id sequence
    (granted by the script), pg_locks and the statistics views (no grant needed)."""
    from relay.sources.table.store import ClaimStore

    store = ClaimStore.of(jobs.owner)
    with psycopg.connect(jobs.as_job["relay"].libpq_dsn, autocommit=True) as conn:
        row = conn.execute(store.last_id).fetchone()
        assert row is not None and row[1] is True
        conn.execute(store.writers).fetchall()
        assert conn.execute(store.dead_rows).fetchone() is not None  # the maintenance watches'
        conn.execute(store.oldest_snapshot).fetchall()
    assert refused(jobs.as_job["consumer"], store.last_id.as_string(None)) == "42501"


async def test_a_relay_without_the_sequence_grant_turns_its_horizon_off(
    jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    """Roles created before this grant existed: the relay says what to grant, once, and
    claims scan their lanes from the start as before (nothing else changes)."""
    from outbox.outages import Dependency
    from outbox.resilience.retry import RetryPolicy
    from relay.database import Database
    from relay.metrics import RelayMetrics
    from relay.outage import OutageGuard
    from relay.sources.table.cursor import ClaimCursors
    from relay.sources.table.horizon import HorizonWatch
    from relay.sources.table.store import ClaimStore

    with psycopg.connect(jobs.owner.libpq_dsn, autocommit=True) as conn:
        seq = conn.execute("SELECT pg_get_serial_sequence(%s, 'id')", (jobs.events,)).fetchone()
        assert seq is not None
        group = jobs.logins["relay"].removesuffix("_login")
        conn.execute(f'REVOKE SELECT ON SEQUENCE {seq[0]} FROM "{group}"')
    relay = jobs.as_job["relay"]
    cursors = ClaimCursors()
    watch = HorizonWatch(
        relay.relay,
        Database(relay),
        ClaimStore.of(relay),
        cursors,
        RelayMetrics(),
        OutageGuard(Dependency("database", logging.getLogger()), RetryPolicy()),
    )
    caplog.set_level("WARNING", logger="relay.horizon")
    watch._conn = await watch._connect()
    try:
        assert await watch._read(0.0) is False
        assert await watch._read(1.0) is False
    finally:
        await watch._close()
    assert cursors.horizon.value is None
    [line] = [r.getMessage() for r in caplog.records if r.name == "relay.horizon"]
    assert "permission denied for sequence" in line and "outbox db sql --roles" in line


def test_the_consumer_cannot_touch_the_outbox(jobs: Jobs) -> None:
    consumer = jobs.as_job["consumer"]
    assert refused(consumer, f"SELECT count(*) FROM {jobs.events}") == "42501"
    assert refused(consumer, f"DELETE FROM {jobs.events}") == "42501"
    insert = (
        f"INSERT INTO {jobs.events} (event_id, topic, lane, event_type, source, content_type,"
        " payload, fingerprint) VALUES (gen_random_uuid(), 't', 0, 'e', 's', 'c', '', '')"
    )
    assert refused(consumer, insert) == "42501"


def test_the_operator_reads_and_deletes_but_does_not_own(jobs: Jobs) -> None:
    operator = jobs.as_job["operator"]
    assert refused(operator, f"SELECT count(*) FROM {jobs.events}") == "allowed"
    assert refused(operator, f"DROP TABLE {jobs.events}") == "42501"
    assert refused(operator, f"TRUNCATE {jobs.events}") == "42501"


def test_the_viewer_reads_and_the_read_only_console_runs_under_it(jobs: Jobs) -> None:
    viewer = jobs.as_job["viewer"]
    assert refused(viewer, f"SELECT count(*) FROM {jobs.events}") == "allowed"
    assert refused(viewer, f"DELETE FROM {jobs.events}") == "42501"
    letters = f'"{jobs.owner.db_schema}"."{jobs.owner.table_prefix}dead_letters"'
    assert refused(viewer, f"DELETE FROM {letters}") == "42501"
    seed_dead_letters(jobs.owner, 3, consumer="viewer-test")
    with console_process(viewer) as (url, _):
        for path in ("/", "/dead-letters?consumer=viewer-test", "/failed", "/effects"):
            page = httpx.get(url + path, timeout=30)
            assert page.status_code == 200, (path, page.text[-500:])
            assert "permission denied" not in page.text
        assert "3 dead letters" in httpx.get(url + "/dead-letters?consumer=viewer-test").text


async def test_every_daemon_does_its_job_under_its_role(
    jobs: Jobs, engine: Engine, daemons: list[Daemon], tmp_path: Path
) -> None:
    topic = f"roles-{uuid.uuid4().hex[:10]}"
    admin = kafka_admin(jobs.owner)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        await admin.close()
    # The user's own table: the user grants it to the consumer's login.
    effects = f"role_effects_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {effects} (event_id text PRIMARY KEY, n int)"))
        conn.execute(text(f'GRANT INSERT ON {effects} TO "{jobs.logins["consumer"]}"'))

    producer = jobs.as_job["producer"]
    pengine = sync_engine(producer)
    try:
        with pengine.begin() as conn:
            ids = Outbox(producer).publish_many(
                conn,
                [
                    Message(topic=topic, key=f"k{n}", event_type="sec.order", payload={"n": n})
                    for n in range(20)
                ]
                + [Message(topic=topic, key="p", event_type="sec.order", payload={"poison": 1})],
            )
    finally:
        pengine.dispose()

    consumer = f"roles-consumer-{uuid.uuid4().hex[:6]}"
    relay = run_daemon(daemons, jobs.as_job["relay"], tmp_path, "relay")
    consume = run_daemon(
        daemons,
        jobs.as_job["consumer"],
        tmp_path,
        "consume",
        "tests.support.secured_apps:app",
        SECURED_TEST_CONSUMER=consumer,
        SECURED_TEST_TOPIC=topic,
        SECURED_TEST_EFFECTS=effects,
    )
    letters = f'"{jobs.owner.db_schema}"."{jobs.owner.table_prefix}dead_letters"'

    def done() -> bool:
        with engine.connect() as conn:
            applied = conn.execute(text(f"SELECT count(*) FROM {effects}")).scalar_one()
            dead = conn.execute(text(f"SELECT count(*) FROM {letters}")).scalar_one()
        return bool(applied == len(ids) - 1 and dead == 1)

    until(
        done,
        90,
        f"20 effects and 1 dead letter (relay: {relay.output()[-2000:]}\n"
        f"consumer: {consume.output()[-2000:]})",
    )

    operator = jobs.as_job["operator"]
    lag = cli(operator, "lag", "--json", "--group", consumer)
    assert lag.returncode == 0, lag.stderr
    group = {g["group"]: g for g in json.loads(lag.stdout)["groups"]}[consumer]
    assert group["dead_letters"] == 1
    doctor = cli(operator, "doctor", "--json")
    findings = json.loads(doctor.stdout)
    assert not [f for f in findings if f["level"] == "error"], doctor.stdout
    await asyncio.sleep(1.1)  # every inbox row is older than the cut-off below
    cleanup = cli(operator, "cleanup", "--json", "--inbox-older-than", "1s")
    assert cleanup.returncode == 0, cleanup.stderr + cleanup.stdout
    deleted = {r["target"]: r["deleted"] for r in json.loads(cleanup.stdout)["results"]}
    assert deleted["inbox"] == len(ids)
    for out in (lag, doctor, cleanup):
        assert "permission denied" not in out.stdout + out.stderr

    assert relay.stop() == 0 and consume.stop() == 0
    for daemon in (relay, consume):
        assert "permission denied" not in daemon.output()
    assert "claim horizon off" not in relay.output()

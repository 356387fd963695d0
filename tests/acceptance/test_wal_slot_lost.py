"""A slot invalidated under the WAL relay (``max_slot_wal_keep_size`` exceeded): the relay
stops at once, exit 2, one line saying events may be lost since which LSN and what to do;
producers are refused meanwhile (WalSlotMissing); ``outbox wal setup`` refuses the lost slot
(exit 2) and ``--recreate-lost`` replaces it, naming the LSNs between which events may be
missing, after which events flow again.

On a PostgreSQL cluster of the test's own (tests/support/private_pg.py): lowering
``max_slot_wal_keep_size`` on the shared server would invalidate every other test's slots.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from outbox import Outbox, WalSlotMissing, migrate
from outbox.db import sync_engine
from outbox.settings import OutboxSettings, WalSettings
from tests.support.kafka import create_topic
from tests.support.private_pg import PrivatePostgres
from tests.support.relay import RelayProcess, outbox_cli, publish_numbered, read_ids, relay_env
from tests.support.wal import wal_env

pytestmark = pytest.mark.acceptance


async def test_an_invalidated_slot_stops_the_relay_with_exit_2_and_one_line(
    pg: PrivatePostgres, kafka_bootstrap: str, tmp_path: Path
) -> None:
    pg.sql("ALTER SYSTEM SET wal_level = logical")
    pg.sql("ALTER SYSTEM SET max_slot_wal_keep_size = '3MB'")
    pg.stop()
    pg.start()
    settings = OutboxSettings(
        database_url=pg.url(),  # type: ignore[arg-type]
        kafka_bootstrap_servers=kafka_bootstrap,
        source="wal",
        wal=WalSettings(slot="outbox_lost", publication="outbox_lost"),
    )
    migrate.upgrade(settings)
    pg.sql("CREATE PUBLICATION outbox_lost")
    pg.sql("SELECT pg_create_logical_replication_slot('outbox_lost', 'pgoutput')")
    topic = await create_topic(kafka_bootstrap)
    engine = sync_engine(settings)
    try:
        ids = publish_numbered(engine, settings, topic, 200)
    finally:
        engine.dispose()
    relay = RelayProcess(relay_env(settings, **wal_env(settings)), tmp_path, "wal")
    try:
        await read_ids(kafka_bootstrap, topic, ids)
        # ~10 MB of WAL the slot has no reason to confirm (no event in it), then a
        # checkpoint: past max_slot_wal_keep_size, the slot is invalidated.
        filler = "SELECT g, repeat(md5(g::text), 16) FROM generate_series(1, 20000) g"
        pg.sql(f"CREATE TABLE filler AS {filler}")
        pg.sql("SELECT pg_switch_wal()")
        pg.sql("CHECKPOINT")
        code = await asyncio.to_thread(relay.proc.wait, 60)
    finally:
        relay.kill()
    log = relay.log()
    lines = [line for line in log.splitlines() if "may be lost" in line]
    assert code == 2, log[-3000:]
    assert len(lines) == 1, log[-3000:]
    assert "since LSN " in lines[0] and "outbox wal setup" in lines[0], lines[0]
    assert "Traceback" not in log

    # Producers are refused while the slot is lost (nothing committed for no slot to read).
    engine = sync_engine(settings)
    try:
        with pytest.raises(WalSlotMissing), engine.begin() as conn:
            Outbox(settings).publish(conn, topic=topic, key="k", event_type="t", payload={})
    finally:
        engine.dispose()
    # `outbox wal setup` says the slot is lost rather than "exists"; --recreate-lost
    # replaces it and says since which LSN events may be missing.
    env = relay_env(settings, **wal_env(settings))
    refused = outbox_cli("wal", "setup", env=env)
    assert refused.returncode == 2, refused.stderr
    assert "is lost" in refused.stderr and "--recreate-lost" in refused.stderr, refused.stderr
    assert "publication and slot exist" not in refused.stderr
    redone = outbox_cli("wal", "setup", "--recreate-lost", env=env)
    assert redone.returncode == 0, redone.stderr
    assert "dropped lost replication slot outbox_lost" in redone.stderr, redone.stderr
    assert "replaced the lost slot outbox_lost: events committed between LSN" in redone.stderr
    assert "Traceback" not in refused.stderr + redone.stderr
    engine = sync_engine(settings)
    try:
        ids = publish_numbered(engine, settings, topic, 10)
    finally:
        engine.dispose()
    relay = RelayProcess(env, tmp_path, "wal-again")
    try:
        await read_ids(kafka_bootstrap, topic, ids)
        assert relay.alive(), relay.log()[-3000:]
    finally:
        relay.kill()

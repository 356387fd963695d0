"""The WAL source's slot on the real server: the relay's gauges move when WAL is written
and nobody confirms it, and fall back when the slot is advanced (what the WAL relay does);
concurrent set-ups (several deploy jobs at once) all succeed."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from outbox.db import sync_engine
from outbox.ops.wal_health import WalGauges
from outbox.ops.wal_lag import lag_seconds
from outbox.ops.wal_slot import ensure, read_slot
from outbox.settings import OutboxSettings
from relay.metrics import RelayMetrics
from tests.support.wal_slots import wal_names

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(base_settings: OutboxSettings) -> Iterator[OutboxSettings]:
    with wal_names(base_settings) as s:
        ensure(s)
        yield s


def sample(s: OutboxSettings, metrics: RelayMetrics) -> dict[str, float]:
    engine = sync_engine(s)
    try:
        with engine.connect() as conn:
            slot = read_slot(conn, s.wal.slot)
    finally:
        engine.dispose()
    metrics.set_wal(WalGauges.of(slot, lag_seconds(s).seconds))
    registry = metrics.registry
    return {
        name: registry.get_sample_value(f"outbox_relay_wal_{name}") or 0.0
        for name in ("retained_bytes", "unconfirmed_bytes", "lag_seconds", "slot_status")
    }


def test_slot_gauges_move_with_unconfirmed_wal(ws: OutboxSettings) -> None:
    metrics = RelayMetrics()
    assert metrics.registry.get_sample_value("outbox_relay_wal_slot_status") == -1  # unmeasured
    before = sample(ws, metrics)
    assert before["slot_status"] == 0 and before["lag_seconds"] == 0

    with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, 'outbox', repeat('x', 1000000))")
    behind = sample(ws, metrics)
    assert behind["unconfirmed_bytes"] >= before["unconfirmed_bytes"] + 1_000_000
    assert behind["retained_bytes"] >= before["retained_bytes"] + 1_000_000
    assert behind["lag_seconds"] > 0

    with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (ws.wal.slot,))
    advanced = sample(ws, metrics)
    assert advanced["lag_seconds"] == 0


def test_concurrent_setups_create_each_object_once_and_all_succeed(
    base_settings: OutboxSettings,
) -> None:
    # The races (both past the existence check; a slot seen half-made) are hit in some rounds.
    for _ in range(20):
        with wal_names(base_settings) as s, ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: ensure(s), range(4)))
            assert sum(r.publication_created for r in results) == 1
            assert sum(r.slot_created for r in results) == 1

"""The relay's slot gauges from a real slot: they move when WAL is written and nobody
confirms it, and fall back when the slot is advanced (what the WAL relay does)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from outbox.db import sync_engine
from outbox.ops.wal_health import WalGauges
from outbox.ops.wal_slot import ensure, lag_seconds, read_slot
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

"""The claim fence against a handover race, statement by statement on real PostgreSQL.

A READ COMMITTED statement takes its snapshot when it starts. A claim that won a lane's fence inside
the claiming statement itself could win it from an old claim transaction that committed *after* that
snapshot: the rows the old transaction put back (re-inserted, in delete mode) would be invisible to
it, while later rows are not — a later row of the key would go out first
(relay/sources/table/store.py, the module docstring). These tests stop one of the new owner's
statements between its snapshot and its first row (at an advisory lock the test holds, taken by a
test-only CTE added to the relay's own statement), commit the old owner's put-back in that window,
and check what the new owner's transaction claimed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from relay.errors import PartitionUnavailable
from relay.event import ID
from relay.sources.table.cursor import LANE_START
from relay.sources.table.store import ClaimStore

pytestmark = pytest.mark.integration

LANE = 0
GATE = 424242  # advisory lock (GATE, 1) the test holds to stop a statement mid-way
HELD = [PartitionUnavailable.MARKER + "%"]


def keeping(settings: OutboxSettings, keep_hours: float) -> OutboxSettings:
    r = settings.relay.model_copy(update={"keep_published_hours": keep_hours})
    return settings.model_copy(update={"relay": r})


def insert_rows(engine: Engine, settings: OutboxSettings, n: int) -> list[int]:
    events = build_tables(settings).events.fullname
    with engine.begin() as conn:
        return [
            conn.execute(
                text(
                    f"INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
                    " content_type, payload, fingerprint) VALUES (gen_random_uuid(), 't', 'k',"
                    " :lane, 'x', 's', 'application/json', '{}', '\\x00') RETURNING id"
                ),
                {"lane": LANE},
            ).scalar_one()
            for _ in range(n)
        ]


def gated(statement: bytes) -> bytes:
    """``statement`` waiting for the test's gate after its snapshot is taken, before
    anything else it does: a one-time filter on its first WHERE."""
    assert b" WHERE " in statement
    gate = b"WITH gate AS MATERIALIZED (SELECT pg_advisory_lock(%d, 1) AS g)" % GATE
    if statement.startswith(b"WITH "):
        statement = gate + b", " + statement[len(b"WITH ") :]
    else:
        statement = gate + b" " + statement
    return statement.replace(b" WHERE ", b" WHERE (SELECT true FROM gate) AND ", 1)


def wait_gated(watcher: psycopg.Connection[Any], pid: int) -> None:
    """Until backend ``pid`` waits at the gate (its statement has its snapshot)."""
    deadline = time.monotonic() + 30
    while (
        watcher.execute(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objid = 1 AND pid = %s",
            (GATE, pid),
        ).fetchone()
        is None
    ):
        if time.monotonic() > deadline:
            raise AssertionError(f"backend {pid} never reached the gate")
        time.sleep(0.01)


class Claimer:
    """A claim transaction as a pipeline runs it: fence, take-over (optional), claim."""

    def __init__(self, settings: OutboxSettings, conn: psycopg.Connection[Any]) -> None:
        self.store = ClaimStore.of(settings)
        self.conn = conn

    def statements(self, take_over: bool, limit: int) -> list[tuple[str, bytes, dict[str, Any]]]:
        store, lanes = self.store, [LANE]
        steps = [("fence", store.fence, {"lanes": lanes})]
        if take_over:
            take = store.release_delays.as_bytes(self.conn)
            steps.append(("take-over", take, {"lanes": lanes, "held": HELD}))
        claim = {"lanes": lanes, "after": [LANE_START], "limit": limit, "max_bytes": 1 << 30}
        return [*steps, ("claim", store.claim, claim)]

    def run(
        self, take_over: bool = False, limit: int = 100, gate: str | None = None
    ) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = []
        for name, statement, params in self.statements(take_over, limit):
            cur = self.conn.execute(
                gated(statement) if name == gate else statement, params, binary=True
            )
            if name == "claim":
                rows = sorted(cur.fetchall(), key=lambda r: r[ID])
        return rows


def race(
    settings: OutboxSettings, ids: list[int], gate: str, delay: float, take_over: bool = False
) -> tuple[list[int], list[int]]:
    """The old owner claims rows 1..10, Kafka acknowledges 1..5; while the new owner's
    ``gate`` statement has its snapshot and waits, the old owner puts 6..10 back (due after
    ``delay``, for a sick partition) and commits. Returns the ids the new owner claimed and
    the ids pending to a later statement of its transaction (those it did not claim)."""
    with (
        psycopg.connect(settings.libpq_dsn) as old_conn,
        psycopg.connect(settings.libpq_dsn) as new_conn,
        psycopg.connect(settings.libpq_dsn, autocommit=True) as watcher,
    ):
        old, new = Claimer(settings, old_conn), Claimer(settings, new_conn)
        rows = old.run(limit=10)
        assert [r[ID] for r in rows] == ids[:10]
        watcher.execute("SELECT pg_advisory_lock(%s, 1)", (GATE,))
        result: list[Any] = []

        def claim() -> None:
            try:
                result.append(new.run(take_over, gate=gate))
            except BaseException as exc:  # raised again in the test's thread
                result.append(exc)

        thread = threading.Thread(target=claim)
        thread.start()
        try:
            wait_gated(watcher, new_conn.info.backend_pid)
            back = rows[5:]
            err = f"{PartitionUnavailable.MARKER}t[0], leader 2"
            for params in old.store.restore_chunks(back, [0] * 5, [err] * 5, [delay] * 5):
                old_conn.execute(old.store.restore, params)
            old_conn.commit()
        finally:
            watcher.execute("SELECT pg_advisory_unlock(%s, 1)", (GATE,))
            thread.join(30)
        assert not thread.is_alive()
        if isinstance(result[0], BaseException):
            raise result[0]
        events = build_tables(settings).events.fullname
        pending = new_conn.execute(
            f"SELECT id FROM {events} WHERE published_at IS NULL ORDER BY id"
        ).fetchall()
        new_conn.rollback()
    return [int(r[ID]) for r in result[0]], [int(r[0]) for r in pending]


@pytest.mark.parametrize("keep_hours", [0, 24], ids=["delete", "keep"])
@pytest.mark.parametrize("gate", ["fence", "claim"])
def test_a_claim_never_passes_rows_an_old_owner_put_back_meanwhile(
    engine: Engine, isolated_settings: OutboxSettings, keep_hours: float, gate: str
) -> None:
    s = keeping(isolated_settings, keep_hours)
    ids = insert_rows(engine, s, 15)
    took, pending = race(s, ids, gate, delay=0.0)
    assert took + pending == ids[5:]  # 1..5 gone, 6..10 back; in id order
    if gate == "fence":
        # The fence was won after the old batch ended: the claim sees its put-back.
        assert took == ids[5:]
    else:
        # The old batch held the fence when the transaction asked: the lane waits a round
        # (before the fence had its own statement, this claim took 11..15).
        assert took == []


@pytest.mark.parametrize("keep_hours", [0, 24], ids=["delete", "keep"])
@pytest.mark.parametrize("gate", ["fence", "take-over"])
def test_a_take_over_makes_rows_put_back_meanwhile_due_first(
    engine: Engine, isolated_settings: OutboxSettings, keep_hours: float, gate: str
) -> None:
    """Rows an old owner put back with a delay (a sick partition) in the window become due
    before the new owner's first claim of the lane (relay/kafka/partitions.py, the take-over)."""
    s = keeping(isolated_settings, keep_hours)
    ids = insert_rows(engine, s, 15)
    took, pending = race(s, ids, gate, delay=3600.0, take_over=True)
    assert took + pending == ids[5:]
    assert took == (ids[5:] if gate == "fence" else [])

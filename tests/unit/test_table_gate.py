"""relay/sources/wal/gate.py: which WAL transactions wait for older outbox-table rows, and when
the table is asked again (a fake connection returning what the statement would)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from relay.sources.wal.gate import TableGate

T0 = datetime(2026, 11, 27, 8, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class _Conn:
    """Answers each "oldest" execute with the next (oldest created_at, read at), and each
    "holding" one with the rows per topic."""

    def __init__(
        self,
        answers: list[tuple[datetime | None, datetime]],
        holding: list[tuple[str, int]] | None = None,
    ) -> None:
        self._answers: Iterator[tuple[datetime | None, datetime]] = iter(answers)
        self._holding = holding or [("orders", 1)]
        self.asked = 0
        self.counted = 0

    async def execute(self, statement: Any, _params: Any = None) -> _Conn:
        if statement == "holding":
            self.counted += 1
        else:
            self.asked += 1
            self._row = next(self._answers)
        return self

    async def fetchone(self) -> tuple[datetime | None, datetime]:
        return self._row

    async def fetchall(self) -> list[tuple[str, int]]:
        return self._holding


def _gauge() -> Gauge:
    return Gauge("holding", "rows", registry=CollectorRegistry())


def _gate(conn: _Conn, gauge: Gauge | None = None, clock: list[float] | None = None) -> TableGate:
    async def connect() -> Any:
        return conn

    now = clock or [0.0]
    return TableGate("oldest", "holding", "due", connect, gauge or _gauge(), lambda: now[0])


async def test_rows_created_after_a_commit_do_not_hold_it_and_one_read_serves_earlier_commits() -> (
    None
):
    conn = _Conn([(at(5), at(10))])  # oldest row created at 5 s, asked at 10 s
    gate = _gate(conn)
    assert await gate.allows(at(1))  # committed before the row began: it is newer
    assert await gate.allows(at(4.9))
    assert conn.asked == 1  # both committed before the read: its answer holds for them


async def test_a_row_created_before_a_commit_holds_it_and_is_asked_for_until_published() -> None:
    conn = _Conn([(at(5), at(10)), (at(5), at(11)), (None, at(12))])
    gate = _gate(conn)
    assert not await gate.allows(at(6))  # the row may have committed first
    assert not await gate.allows(at(6))  # still there: asked again while holding
    assert await gate.allows(at(6))  # published by the table relays
    assert conn.asked == 3


async def test_a_commit_after_the_last_read_asks_again() -> None:
    conn = _Conn([(None, at(10)), (at(11), at(20))])
    gate = _gate(conn)
    assert await gate.allows(at(9))
    assert not await gate.allows(at(12))  # committed after the read: a row of 11 s holds it
    assert conn.asked == 2


async def test_while_rows_hold_the_stream_it_warns_every_minute_with_counts_and_the_gauge(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    held = [(at(5), at(10 + i)) for i in range(4)]
    conn = _Conn([*held, (None, at(20))], holding=[("orders", 3), ("payments", 1)])
    registry = CollectorRegistry()
    gauge = Gauge("holding", "rows", registry=registry)
    gate = _gate(conn, gauge, now)
    with caplog.at_level("INFO", logger="relay.wal"):
        assert not await gate.allows(at(6))
        now[0] += 30
        assert not await gate.allows(at(6))  # within the minute: not said again
        now[0] += 31
        assert not await gate.allows(at(6))  # a minute on: said again, counted afresh
        assert not await gate.allows(at(6))
        assert registry.get_sample_value("holding") == 4
        assert await gate.allows(at(6))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and conn.counted == 2
    assert "holds 4 unpublished row(s)" in warnings[0] and "(orders 3, payments 1)" in warnings[0]
    assert "this relay publishes them" in warnings[0]
    assert registry.get_sample_value("holding") == 0
    assert caplog.records[-1].getMessage().endswith("publishing from the slot")

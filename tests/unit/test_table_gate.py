"""relay/sources/wal/gate.py: which WAL transactions wait for older outbox-table rows, and when
the table is asked again (a fake connection returning what the statement would)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from relay.sources.wal.gate import TableGate

T0 = datetime(2026, 11, 27, 8, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class _Conn:
    """Answers each execute with the next (oldest unpublished created_at, read at)."""

    def __init__(self, answers: list[tuple[datetime | None, datetime]]) -> None:
        self._answers: Iterator[tuple[datetime | None, datetime]] = iter(answers)
        self.asked = 0

    async def execute(self, _statement: Any) -> _Conn:
        self.asked += 1
        self._row = next(self._answers)
        return self

    async def fetchone(self) -> tuple[datetime | None, datetime]:
        return self._row


def _gate(conn: _Conn) -> TableGate:
    async def connect() -> Any:
        return conn

    return TableGate("statement", connect)


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

"""The inbox store's attempt-marker statements against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox.event import InboxEvent
from inbox.store import InboxStore, Marker
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

pytestmark = pytest.mark.integration


async def test_disarming_on_release_leaves_a_new_owners_marker_alone(
    settings: OutboxSettings, aengine: AsyncEngine
) -> None:
    store = InboxStore(build_tables(settings))
    consumer, topic = f"c-{uuid.uuid4().hex[:8]}", "orders"
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        # The old owner armed (10, 41) ahead; the new owner took over and is retrying
        # offset 10 alone after a crash: its marker counts two attempts.
        await store.set_marker(conn, consumer, topic, 0, Marker(10, 10, 2, "ProcessCrashed"))
        await store.disarm_marker(conn, consumer, topic, 0, (10, 41))  # the old owner, late
        assert await store.marker(conn, consumer, topic, 0) == Marker(10, 10, 2, "ProcessCrashed")

        # Its own marker, still as it armed it: disarmed.
        await store.set_marker(conn, consumer, topic, 1, Marker(10, 41, 1, None))
        await store.disarm_marker(conn, consumer, topic, 1, (10, 41))
        assert await store.marker(conn, consumer, topic, 1) == Marker(10, 41, 0, None)


def _event(offset: int) -> InboxEvent:
    return InboxEvent(str(uuid.uuid4()), "order.created", "orders", 0, offset, None, b"{}", ())


async def test_begin_and_claim_opens_a_transaction_that_the_callers_rollback_or_commit_ends(
    settings: OutboxSettings, aengine: AsyncEngine
) -> None:
    store = InboxStore(build_tables(settings))
    consumer = f"c-{uuid.uuid4().hex[:8]}"
    a, b = _event(1), _event(2)
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")

    async def status(event: InboxEvent) -> str | None:
        async with aengine.connect() as conn:
            return await store.inbox_status(conn, consumer, event.event_id)

    async with auto.connect() as conn:
        trans = await conn.begin()
        assert await store.begin_and_claim(conn, consumer, [a]) == {a.event_id}
        await trans.rollback()
    # Had the claim committed on its own (autocommit), the row would be there.
    assert await status(a) is None

    async with auto.connect() as conn, conn.begin():
        assert await store.begin_and_claim(conn, consumer, [a, b]) == {a.event_id, b.event_id}
    assert await status(b) == "processed"

    c = _event(3)
    async with auto.connect() as conn, conn.begin():
        # ``a`` is a duplicate now: only ``c`` is new.
        assert await store.begin_and_claim(conn, consumer, [a, c]) == {c.event_id}
    assert await status(c) == "processed"


async def test_the_claim_keeps_every_field_of_odd_ids_and_types(
    settings: OutboxSettings, aengine: AsyncEngine
) -> None:
    """The claim sends its rows as one JSON document: quotes, backslashes, non-ASCII text
    and a missing type arrive unchanged."""
    store = InboxStore(build_tables(settings))
    consumer = f"c-{uuid.uuid4().hex[:8]}"
    odd = [
        InboxEvent('q"uote\\back', "t.é", "orders", 3, 2**40, None, b"{}", ()),
        InboxEvent("ünï-😀", None, "other-topic", 0, 0, None, b"{}", ()),
        InboxEvent("x" * 255, "x.y", "orders", 2**31 - 1, 7, None, b"{}", ()),
    ]
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        assert await store.claim(conn, consumer, odd) == {e.event_id for e in odd}
        assert await store.claim(conn, consumer, odd) == set()  # duplicates now
        inbox = f"{settings.db_schema}.{settings.table_prefix}inbox"
        rows = await conn.execute(
            text(
                f'SELECT event_id, event_type, topic, partition, "offset" FROM {inbox} '
                "WHERE consumer = :c"
            ),
            {"c": consumer},
        )
        got = {tuple(r) for r in rows}
    assert got == {(e.event_id, e.event_type, e.topic, e.partition, e.offset) for e in odd}


class _CountingCursor(psycopg.AsyncCursor[Any]):
    """Counts the statements a connection runs (one execute = one statement here)."""

    executed = 0

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        type(self).executed += 1
        return await super().execute(*args, **kwargs)


async def _sequence(settings: OutboxSettings, consumer: str, key: bytes) -> int | None:
    async with await psycopg.AsyncConnection.connect(settings.libpq_dsn) as conn:
        table = build_tables(settings).inbox_sequences.fullname
        cur = await conn.execute(
            f"SELECT sequence FROM {table} WHERE consumer = %s AND key = %s", (consumer, key)
        )
        row = await cur.fetchone()
        return None if row is None else int(row[0])


async def test_a_batch_handlers_stale_checks_are_one_statement_judged_in_list_order(
    settings: OutboxSettings,
) -> None:
    store = InboxStore(build_tables(settings))
    consumer = f"c-{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(settings.libpq_dsn) as conn:
        assert await store.advance_sequence(conn, consumer, b"a", 10)
        assert await store.advance_sequence(conn, consumer, b"b", 10)
        await conn.commit()
    items = [
        (b"a", 9), (b"a", 11), (b"b", 4), (b"b", 10), (b"new", 3), (b"new", 1),
        (b"new", 5), (b"a", 10), (b"a", 12), (b"new", 5),
    ]  # fmt: skip
    _CountingCursor.executed = 0
    async with await psycopg.AsyncConnection.connect(
        settings.libpq_dsn, cursor_factory=_CountingCursor
    ) as conn:
        current = await store.advance_sequences(conn, consumer, items)
        assert _CountingCursor.executed == 1  # the whole list, not one per event
        await conn.commit()
    # Each item against the highest applied before it, the list's own earlier ones included.
    assert current == [False, True, False, False, True, False, True, False, True, False]
    assert [await _sequence(settings, consumer, k) for k in (b"a", b"b", b"new")] == [12, 10, 5]


@pytest.mark.parametrize("existing", [10, None], ids=["existing key", "new key"])
async def test_a_key_another_transaction_moves_meanwhile_is_judged_on_its_committed_value(
    settings: OutboxSettings, existing: int | None
) -> None:
    # A replay racing the live stream: the other transaction has moved the key to 20, not
    # committed yet, when the list's statement takes its snapshot (which still says 10, or
    # nothing); the statement waits for its lock, the other commits. 15 is then stale.
    store = InboxStore(build_tables(settings))
    consumer = f"c-{uuid.uuid4().hex[:8]}"
    dsn = settings.libpq_dsn
    async with (
        await psycopg.AsyncConnection.connect(dsn) as other,
        await psycopg.AsyncConnection.connect(dsn) as conn,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher,
    ):
        if existing is not None:
            assert await store.advance_sequence(other, consumer, b"k", existing)
            await other.commit()
        assert await store.advance_sequence(other, consumer, b"k", 20)  # not committed
        judged = asyncio.create_task(
            store.advance_sequences(conn, consumer, [(b"k", 15), (b"k", 25)])
        )
        pid = conn.info.backend_pid
        for _ in range(3000):  # until the list's statement waits for the row
            cur = await watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                (pid,),
            )
            if await cur.fetchone() is not None or judged.done():
                break
            await asyncio.sleep(0.01)
        assert not judged.done(), "the list's statement did not wait for the other's lock"
        await other.commit()
        assert await judged == [False, True]
        await conn.commit()
    assert await _sequence(settings, consumer, b"k") == 25

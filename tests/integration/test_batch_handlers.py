"""Batch handlers through the real processing path (``InboxHarness``: the daemon's
``PartitionProcessor`` on real PostgreSQL, without Kafka): one call per run, duplicates
kept out of the list, a failing call split down to the failing event, which alone is
retried or dead-lettered, ``Permanent(event=...)``, ``stale="skip"``, contexts, sync
handlers, and a per-event handler on the same topic."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import EventContext, InboxEvent, Permanent
from inbox.sql import PROCESSED
from inbox.testing import InboxHarness
from outbox.settings import OutboxSettings

pytestmark = pytest.mark.integration


class Item(BaseModel):
    n: int
    poison: bool = False
    bad: bool = False


@pytest.fixture
def table(engine: Engine) -> Iterator[str]:
    name = f"batch_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n int NOT NULL, kind text NOT NULL)"))
    yield name
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {name}"))


def rows(engine: Engine, table: str) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(text(f"SELECT n, kind FROM {table}"))]


def _insert(table: str) -> str:
    # One statement for the whole list: what a batch handler is for.
    return f"INSERT INTO {table} (n, kind) SELECT n, 'batch' FROM unnest(CAST(:ns AS int[])) n"


def _app(table: str, calls: list[list[int]], **options: object) -> inbox.Consumer:
    app = inbox.Consumer(name=f"batch-{uuid.uuid4().hex[:8]}", topics=["items"])

    @app.handler("item", batch=True, max_attempts=3, **options)  # type: ignore[arg-type]
    async def project(items: list[Item], session: AsyncSession) -> None:
        calls.append([i.n for i in items])
        for item in items:
            if item.poison:
                raise RuntimeError("cannot project this item")
            if item.bad:
                raise Permanent("bad item", event=item)
        await session.execute(text(_insert(table)), {"ns": [i.n for i in items]})

    @app.handler("single")
    async def single(item: Item, session: AsyncSession) -> None:
        await session.execute(
            text(f"INSERT INTO {table} (n, kind) VALUES (:n, 'single')"), {"n": item.n}
        )

    return app


def events(harness: InboxHarness, count: int, **marks: int) -> list[InboxEvent]:
    """``count`` item events n = 0..count-1; ``poison=k``/``bad=k``: item k is one."""
    return [
        harness.event("item", Item(n=n, **{m: True for m, k in marks.items() if k == n}), key="k")
        for n in range(count)
    ]


async def test_one_call_takes_the_whole_run_in_offset_order(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        result = await harness.deliver_batch(events(harness, 300))
    assert calls == [list(range(300))]
    assert (result.handled, result.calls, result.counts["transactions"]) == (300, 1, 1)
    assert sorted(rows(engine, table)) == [(n, "batch") for n in range(300)]


async def test_max_batch_bounds_each_call(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls, max_batch=64), settings) as harness:
        result = await harness.deliver_batch(events(harness, 150))
    assert [len(c) for c in calls] == [64, 64, 22]
    assert [n for c in calls for n in c] == list(range(150))
    assert result.handled == 150 and len(rows(engine, table)) == 150


async def test_one_poison_among_500_is_dead_lettered_alone_and_499_apply_once(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        batch = events(harness, 500, poison=321)
        result = await harness.deliver_batch(batch)
        assert await harness.status(batch[321]) == "dead_lettered"
    applied = [n for n, _ in rows(engine, table)]
    assert sorted(applied) == [n for n in range(500) if n != 321]  # each once
    [dead] = result.dead_letters
    assert (dead.event_id, dead.error_class, dead.attempts) == (
        batch[321].event_id,
        "RuntimeError",
        3,
    )
    assert (result.handled, result.counts["dead_lettered"]) == (499, 1)
    # The poison ran alone for its attempts; the split never tried what comes after it.
    alone = [c for c in calls if c == [321]]
    assert len(alone) >= 3
    assert all(321 not in c or c == [321] or c[0] <= 321 for c in calls)


async def test_permanent_naming_its_event_dead_letters_it_without_a_split(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        batch = events(harness, 200, bad=57)
        result = await harness.deliver_batch(batch)
    [dead] = result.dead_letters
    assert (dead.event_id, dead.error_class, dead.attempts) == (batch[57].event_id, "Permanent", 1)
    assert dead.error_message == "bad item"
    # The whole list, then the events before it, then the events after it: no halves, and
    # the bad event is not run again.
    assert calls == [list(range(200)), list(range(57)), list(range(58, 200))]
    assert sorted(n for n, _ in rows(engine, table)) == [n for n in range(200) if n != 57]


async def test_a_payload_that_fails_validation_is_dead_lettered_alone(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        batch = events(harness, 20)
        batch[5] = harness.event("item", {"n": "not a number"}, key="k")
        result = await harness.deliver_batch(batch)
    [dead] = result.dead_letters
    assert (dead.event_id, dead.error_class) == (batch[5].event_id, "ValidationError")
    assert len(rows(engine, table)) == 19


async def test_duplicates_never_reach_the_list(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        first = events(harness, 10)
        await harness.deliver_batch(first)
        more = [harness.event("item", Item(n=n), key="k") for n in range(10, 15)]
        # Redelivered (the same ids again), interleaved with new ones, and one new event
        # twice in the same fetch.
        mixed = [*first[:5], more[0], *first[5:], *more, more[4]]
        result = await harness.deliver_batch(mixed)
    assert calls == [list(range(10)), list(range(10, 15))]
    assert (result.handled, result.counts["duplicates"]) == (5, 12)
    assert sorted(n for n, _ in rows(engine, table)) == list(range(15))


async def test_stale_events_are_left_out_of_the_list(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls, stale="skip"), settings) as harness:
        ordered = [
            harness.event("item", Item(n=n), key="k", sequence=seq)
            for n, seq in ((0, 5), (1, 3), (2, 6), (3, 6))
        ]
        result = await harness.deliver_batch(ordered)
    assert calls == [[0, 2]]
    assert (result.handled, result.counts["stale"]) == (4, 2)


async def test_contexts_match_the_list_and_sync_handlers_get_a_session(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    seen: list[tuple[list[int], list[EventContext]]] = []
    app = inbox.Consumer(name=f"batch-{uuid.uuid4().hex[:8]}", topics=["items"])

    @app.handler("item", batch=True)
    def project(items: list[Item], session: Session, contexts: list[EventContext]) -> None:
        seen.append(([i.n for i in items], contexts))
        session.execute(text(_insert(table)), {"ns": [i.n for i in items]})

    async with InboxHarness(app, settings) as harness:
        batch = events(harness, 5)
        await harness.deliver_batch(batch)
    [(ns, contexts)] = seen
    assert ns == list(range(5))
    assert [c.event_id for c in contexts] == [e.event_id for e in batch]
    assert {c.attempt for c in contexts} == {1}
    assert len(rows(engine, table)) == 5


async def test_raw_events_and_a_per_event_handler_on_the_same_topic_keep_order(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        mixed = [
            harness.event("single" if n % 4 == 3 else "item", Item(n=n), key="k") for n in range(12)
        ]
        result = await harness.deliver_batch(mixed)
    assert calls == [[0, 1, 2], [4, 5, 6], [8, 9, 10]]
    assert result.handled == 12
    assert sorted(rows(engine, table)) == sorted(
        (n, "single" if n % 4 == 3 else "batch") for n in range(12)
    )


async def test_a_single_delivery_reaches_a_batch_handler_as_a_list_of_one(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    async with InboxHarness(_app(table, calls), settings) as harness:
        delivery = await harness.deliver("item", Item(n=7), key="k")
        poisoned = await harness.deliver("item", Item(n=8, poison=True), key="k")
    assert delivery.outcome == "handled" and poisoned.outcome == "dead_lettered"
    assert calls == [[7], [8], [8], [8]]
    assert poisoned.dead_letter is not None and poisoned.dead_letter.attempts == 3


# PostgreSQL itself raises SQLSTATE 40001, as a conflict of a SERIALIZABLE handler would:
# the real error through the real driver, at the moment the test chooses.
_CONFLICT = "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'serialization_failure'; END $$"


async def test_a_serialization_conflict_inside_a_list_reruns_it_and_charges_no_attempt(
    settings: OutboxSettings, engine: Engine, table: str
) -> None:
    calls: list[list[int]] = []
    conflicted: set[int] = set()  # indices in calls
    conflicts = 3  # three in a row: each time the list runs again, first event alone
    app = inbox.Consumer(name=f"batch-{uuid.uuid4().hex[:8]}", topics=["items"])

    # One attempt only: a conflict charged as an attempt would dead-letter the event.
    @app.handler("item", batch=True, max_attempts=1)
    async def project(items: list[Item], session: AsyncSession) -> None:
        nonlocal conflicts
        calls.append([i.n for i in items])
        await session.execute(text(_insert(table)), {"ns": [i.n for i in items]})
        if conflicts and any(i.n == 120 for i in items):
            conflicts -= 1
            conflicted.add(len(calls) - 1)
            await session.execute(text(_CONFLICT))

    async with InboxHarness(app, settings) as harness:
        batch = events(harness, 200)
        result = await harness.deliver_batch(batch)
        statuses = {await harness.status(e) for e in batch}
    assert conflicts == 0
    # The calls that did not conflict took every item once, in offset order.
    assert [n for k, c in enumerate(calls) if k not in conflicted for n in c] == list(range(200))
    # Every item applied once (the conflicting calls' rows rolled back), none dead-lettered.
    assert sorted(n for n, _ in rows(engine, table)) == list(range(200))
    assert (result.handled, result.dead_letters, result.counts["dead_lettered"]) == (200, (), 0)
    assert statuses == {PROCESSED}

"""Database errors met by a handler, classified by their SQLSTATE (outbox/dberrors.py), with
a real PostgreSQL and Kafka and the consumer in this process.

Every error here is a real server error, raised by a real failing statement in the
handler's own session: a read-only transaction refusing an INSERT (25006), and
``RAISE ... USING ERRCODE`` for the ones a test cannot cause on the shared server without
breaking other tests (a full disk, a deadlock); the full disk and the read-only switch of a
whole server are in tests/acceptance/test_database_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox.context import EventContext
from outbox.effects import EffectNotFound, Effects
from outbox.resilience import RetryPolicy
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.inbox import (
    RunningConsumer,
    ce_headers,
    effect_counts,
    effects_table,
    fast_settings,
    produce,
    wait_for,
)
from tests.support.kafka import read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]


def _raise(sqlstate: str, message: str) -> str:
    # A server error with this SQLSTATE, raised by the server for a real statement.
    return f"DO $$ BEGIN RAISE EXCEPTION '{message}' USING ERRCODE = '{sqlstate}'; END $$"


async def _read_only_insert(session: AsyncSession, table: str) -> None:
    """What a handler meets while writes are switched off: 25006 from its own INSERT."""
    await session.execute(text("SET TRANSACTION READ ONLY"))
    await session.execute(text(f"INSERT INTO {table} (event_id) VALUES ('refused')"))


def _records(n: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [
        (b"k", json.dumps({"seq": i}).encode(), ce_headers(f"e{i}-{uuid.uuid4().hex[:6]}"))
        for i in range(n)
    ]


def _finished(c: RunningConsumer) -> int:
    """Events applied or dead-lettered (a wrong outcome fails its assertion, not a wait)."""
    return c.metrics.counts["processed"] + c.metrics.counts["dead_lettered"]


def _inbox_attempts(engine: Engine, settings: OutboxSettings, consumer: str) -> list[int]:
    t = build_tables(settings).inbox
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.attempts).where(t.c.consumer == consumer))
        return sorted(r[0] for r in rows)


def _dead_letters(engine: Engine, settings: OutboxSettings, consumer: str) -> list[str]:
    t = build_tables(settings).dead_letters
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.error_class).where(t.c.consumer == consumer))
        return [r[0] for r in rows]


def _app(
    topic: str, table: str, runs: list[int], fail: Callable[[int], str | None]
) -> inbox.Consumer:
    """One handler with a single allowed attempt: whatever is counted dead-letters it.
    ``fail(run)`` names the failure of the handler's run number ``run`` (0-based, over all
    events), or None to store the event."""
    app = inbox.Consumer(name=f"dberr-{uuid.uuid4().hex[:8]}", topics=[topic])

    @app.handler("test.event", max_attempts=1)
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        run = len(runs)
        runs.append(json.loads(event.value or b"{}")["seq"])
        how = fail(run)
        if how == "read-only":
            await _read_only_insert(session, table)
        elif how is not None:
            sqlstate, message = how.split(" ", 1)
            await session.execute(text(_raise(sqlstate, message)))
        await session.execute(
            text(f"INSERT INTO {table} (event_id, seq) VALUES (:e, :s)"),
            {"e": event.event_id, "s": runs[-1]},
        )

    return app


@pytest.mark.parametrize(
    "failure",
    ["53100 could not extend file: No space left on device", "read-only", "57P01 shutting down"],
)
async def test_a_database_outage_in_the_handlers_own_session_counts_no_attempt(
    failure: str,
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    runs: list[int] = []
    # The first 3 runs meet the outage (the first in a batch of 3, then as it is retried).
    app = _app(topic, table, runs, lambda run: failure if run < 3 else None)
    await produce(kafka_bootstrap, topic, _records(3))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: _finished(c) >= 3, what="all 3 finished")
        database = c.daemon.database
    # With one attempt allowed, a counted failure would have dead-lettered the event.
    assert c.metrics.counts["dead_lettered"] == 0 and c.metrics.counts["retries"] == 0
    assert _dead_letters(engine, settings, app.name) == []
    assert _inbox_attempts(engine, settings, app.name) == [1, 1, 1]
    assert sorted(effect_counts(engine, table).values()) == [1, 1, 1]
    assert runs[:3] == [0, 0, 0] and sorted(set(runs)) == [0, 1, 2]
    # Seen as the database's state: one outage (however many tries), and it is back.
    assert database.outages >= 1 and database.tries >= 3 and database.up


async def test_a_deadlock_runs_the_same_attempt_again_at_once(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    runs: list[int] = []
    deadlock = "40P01 deadlock detected"
    app = _app(topic, table, runs, lambda run: deadlock if run < 3 else None)
    await produce(kafka_bootstrap, topic, _records(1))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: _finished(c) >= 1, what="finished")
        database = c.daemon.database
    assert runs == [0, 0, 0, 0]
    assert c.metrics.counts["dead_lettered"] == 0 and c.metrics.counts["retries"] == 0
    assert _inbox_attempts(engine, settings, app.name) == [1]
    # A conflict is not an outage: no backoff, nothing logged as the database going.
    assert database.outages == 0


async def test_endless_conflicts_are_bounded_and_then_count_as_attempts(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    runs: list[int] = []
    app = _app(topic, table, runs, lambda run: "40001 could not serialize access")
    await produce(kafka_bootstrap, topic, _records(1))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 1, what="dead-lettered")
    # The fast run, then the attempt alone and its 5 immediate re-runs; then it counts.
    assert len(runs) == 1 + 1 + 5
    assert _dead_letters(engine, settings, app.name) == ["OperationalError"]


async def test_the_handlers_own_errors_keep_counting_attempts(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    """Unchanged: a handler's own error, or a database error that is the statement's own
    (a unique violation), is charged to the event and dead-letters it after its attempts."""
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=f"dberr-{uuid.uuid4().hex[:8]}", topics=[topic])
    runs: list[int] = []

    @app.handler("test.event", max_attempts=3)
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        seq = json.loads(event.value or b"{}")["seq"]
        runs.append(seq)
        if seq == 0:
            raise RuntimeError("the handler's own bug")
        await session.execute(text(_raise("23505", "duplicate key value")))

    await produce(kafka_bootstrap, topic, _records(2))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] >= 2, what="both dead-lettered")
    assert runs.count(0) == 3 and runs.count(1) == 3
    assert sorted(_dead_letters(engine, settings, app.name)) == ["IntegrityError", "RuntimeError"]
    dlq = await read_all(kafka_bootstrap, topic + ".dlq", expect=2)
    assert sorted(r.headers["dlq_attempts"] for r in dlq) == [b"3", b"3"]
    assert effect_counts(engine, table) == {}


async def test_an_attempt_the_database_interrupted_is_the_same_attempt_afterwards(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    """Run 1 fails on its own (attempt 1, counted); attempt 2 is then interrupted twice by a
    full disk after its marker was written. Without the fix the marker read back after the
    outage counts as a crash (attempt 2 used up: dead-lettered as ProcessCrashed); with it,
    attempt 2 runs again and applies the event."""
    topic = await new_topic()
    table = effects_table(engine)
    app = inbox.Consumer(name=f"dberr-{uuid.uuid4().hex[:8]}", topics=[topic])
    runs: list[int] = []

    @app.handler("test.event", max_attempts=2)
    async def handle(event: inbox.InboxEvent, session: AsyncSession, ctx: EventContext) -> None:
        attempt = ctx.attempt
        runs.append(attempt)
        if len(runs) == 1:
            raise RuntimeError("the handler's own error, once")
        if len(runs) <= 3:
            await session.execute(text(_raise("53100", "could not extend file")))
        await session.execute(
            text(f"INSERT INTO {table} (event_id, seq) VALUES (:e, :s)"),
            {"e": event.event_id, "s": attempt},
        )

    await produce(kafka_bootstrap, topic, _records(1))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: _finished(c) >= 1, what="applied or dead-lettered")
        database = c.daemon.database
    assert _dead_letters(engine, settings, app.name) == []
    assert runs == [1, 2, 2, 2]
    assert _inbox_attempts(engine, settings, app.name) == [2]
    assert list(effect_counts(engine, table).values()) == [1]
    assert database.outages >= 1


def test_an_effect_whose_call_meets_a_full_disk_is_retried_never_parked_or_failed(
    settings: OutboxSettings, engine: Engine
) -> None:
    """A call that writes to a database and meets a full disk (a real 53100 from a real
    statement) did not apply: the ledger retries it under its policy and, when the disk
    stays full, releases the key and raises the error, instead of parking the key as
    ``unknown`` (no reconcile given) or storing it as ``failed``. The next caller with the
    key calls again, once the disk has room."""
    effects = Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.01, cap_seconds=0.02, max_attempts=3),
        registry=CollectorRegistry(),
    )
    key = f"test-{uuid.uuid4()}"
    calls: list[str] = []

    def full_disk(k: str) -> str:
        calls.append(k)
        with engine.connect() as conn:
            conn.execute(text(_raise("53100", "could not extend file: No space left on device")))
        return "never"

    with pytest.raises(OperationalError) as raised:
        effects.run(engine, key=key, call=full_disk, payload={"n": 1})
    assert raised.value.orig is not None and raised.value.orig.sqlstate == "53100"
    assert len(calls) == 3  # retried under the policy: it was not applied
    with pytest.raises(EffectNotFound):
        effects.get(engine, key)  # released: neither unknown nor failed
    assert effects.run(engine, key=key, call=lambda k: "done", payload={"n": 1}) == "done"
    assert effects.get(engine, key).state == "done"


async def test_a_real_deadlock_in_a_handler_is_run_again_without_an_attempt(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    """A real deadlock: the handler locks row 1 then row 2, another transaction row 2 then
    row 1. The handler waits first and the other transaction's deadlock check is set far
    off, so PostgreSQL's check picks the handler's transaction as the victim (40P01). With
    one attempt allowed, the event is applied, not dead-lettered."""
    topic = await new_topic()
    table = effects_table(engine)
    locks = f"locks_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {locks} (id int PRIMARY KEY)"))
        conn.execute(text(f"INSERT INTO {locks} VALUES (1), (2)"))
    side_holds, handler_waits = threading.Event(), threading.Event()
    side_errors: list[BaseException] = []

    def other_transaction() -> None:
        try:
            with engine.begin() as conn:
                conn.execute(text("SET LOCAL deadlock_timeout = '20s'"))
                conn.execute(text(f"SELECT id FROM {locks} WHERE id = 2 FOR UPDATE"))
                side_holds.set()
                handler_waits.wait(10)
                time.sleep(0.3)  # the handler is waiting for row 2 by now
                conn.execute(text(f"SELECT id FROM {locks} WHERE id = 1 FOR UPDATE"))
        except BaseException as exc:
            side_errors.append(exc)

    app = inbox.Consumer(name=f"dberr-{uuid.uuid4().hex[:8]}", topics=[topic])
    errors: list[str] = []

    @app.handler("test.event", max_attempts=1)
    async def handle(event: inbox.InboxEvent, session: AsyncSession) -> None:
        first = not errors and not side_holds.is_set()
        try:
            if first:
                await session.execute(text(f"SELECT id FROM {locks} WHERE id = 1 FOR UPDATE"))
                threading.Thread(target=other_transaction, daemon=True).start()
                await asyncio.to_thread(side_holds.wait, 10)
                handler_waits.set()
                await session.execute(text(f"SELECT id FROM {locks} WHERE id = 2 FOR UPDATE"))
        except Exception as exc:
            errors.append(getattr(getattr(exc, "orig", None), "sqlstate", None) or repr(exc))
            raise
        await session.execute(
            text(f"INSERT INTO {table} (event_id, seq) VALUES (:e, 0)"), {"e": event.event_id}
        )

    await produce(kafka_bootstrap, topic, _records(1))
    async with RunningConsumer(app, fast_settings(settings)) as c:
        await wait_for(lambda: _finished(c) >= 1, what="applied or dead-lettered")
    assert errors == ["40P01"] and side_errors == []
    assert c.metrics.counts["dead_lettered"] == 0 and c.metrics.counts["retries"] == 0
    assert _inbox_attempts(engine, settings, app.name) == [1]
    assert list(effect_counts(engine, table).values()) == [1]

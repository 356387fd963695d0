"""`outbox cleanup` as a subprocess: it deletes exactly what is past retention, in batches,
and a relay running at the same time neither blocks it nor loses an event."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text, update

from outbox import Outbox
from outbox.envelope import Message
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.acceptance.conftest import Cli, SchemaFactory
from tests.support.kafka import read_all
from tests.support.retention import add_effects, add_idempotency, add_inbox, ago, counts

pytestmark = pytest.mark.acceptance


def publish(engine: Engine, s: OutboxSettings, topic: str, n: int) -> list[int]:
    """Commit ``n`` events; returns their row ids."""
    e = build_tables(s).events
    messages = [
        Message(topic=topic, key=f"k{i % 7}", event_type="t.clean", payload={"i": i})
        for i in range(n)
    ]
    with engine.begin() as conn:
        event_ids = Outbox(s).publish_many(conn, messages)
        return list(conn.execute(select(e.c.id).where(e.c.event_id.in_(event_ids))).scalars())


def age_rows(
    engine: Engine, s: OutboxSettings, ids: list[int], created: str, published: str | None
) -> None:
    e = build_tables(s).events
    with engine.begin() as conn:
        conn.execute(
            update(e)
            .where(e.c.id.in_(ids))
            .values(
                created_at=ago(created),
                available_at=ago(created),
                published_at=None if published is None else ago(published),
            )
        )


def add_failed(engine: Engine, s: OutboxSettings, n: int, failed: str) -> None:
    t = build_tables(s)
    e, f = t.events, t.failed
    ids = publish(engine, s, "t-failed", n)
    cols = [c.name for c in f.columns if c.name != "failed_at"]
    with engine.begin() as conn:
        conn.execute(
            insert(f).from_select(
                [*cols, "failed_at"],
                select(*(e.c[c] for c in cols), ago(failed)).where(e.c.id.in_(ids)),
            )
        )
        conn.execute(e.delete().where(e.c.id.in_(ids)))


def results(report: dict[str, Any]) -> dict[str, int]:
    return {r["target"]: r["deleted"] for r in report["results"]}


def test_cleanup_removes_only_what_is_past_retention(
    fresh_schema: SchemaFactory, acceptance_engine: Engine
) -> None:
    engine = acceptance_engine
    s = fresh_schema(keep_published_hours=1, dedupe_window_days=7)
    age_rows(engine, s, publish(engine, s, "t-a", 30), created="3 hours", published="2 hours")
    age_rows(engine, s, publish(engine, s, "t-a", 20), created="3 hours", published="10 minutes")
    age_rows(engine, s, publish(engine, s, "t-a", 10), created="3 hours", published=None)
    add_inbox(engine, s, 25, processed="10 days")
    add_inbox(engine, s, 15, processed="1 day")
    add_idempotency(engine, s, 12, expires=ago("1 hour"))
    add_idempotency(engine, s, 8, expires=func.now() + text("interval '1 hour'"))
    add_effects(engine, s, 9, "done", expires=ago("1 hour"))
    add_effects(engine, s, 2, "failed", expires=ago("1 hour"))
    add_effects(engine, s, 3, "done", expires=func.now() + text("interval '1 hour'"))
    add_effects(engine, s, 4, "unknown", expires=None)  # never purged, whatever its age
    add_effects(engine, s, 1, "pending", expires=None)
    add_failed(engine, s, 5, failed="2 days")
    before = counts(engine, s)
    assert before == {"events": 60, "inbox": 40, "idempotency": 20, "effects": 19, "failed": 5}
    cli = Cli(s)

    dry = cli.json("cleanup", "--dry-run", "--batch-size", "7")
    assert results(dry) == {"events": 30, "inbox": 25, "idempotency": 12, "effects": 11}
    assert counts(engine, s) == before  # a dry run deletes nothing

    done = cli.json("cleanup", "--batch-size", "7")
    assert results(done) == {"events": 30, "inbox": 25, "idempotency": 12, "effects": 11}
    batches = {r["target"]: r["batches"] for r in done["results"]}
    assert batches["inbox"] >= 4 and batches["idempotency"] >= 2  # 7 rows at a time
    assert batches["effects"] >= 2
    assert counts(engine, s) == {
        "events": 30, "inbox": 15, "idempotency": 8, "effects": 8, "failed": 5,
    }  # fmt: skip
    e = build_tables(s).events
    with engine.connect() as conn:
        left = conn.execute(
            select(func.count()).where(e.c.published_at < func.now() - text("interval '1 hour'"))
        ).scalar_one()
    assert left == 0

    # failed rows are only touched on request, and then only the old enough ones
    assert results(cli.json("cleanup", "--failed-older-than", "3d")) == {
        "events": 0, "inbox": 0, "idempotency": 0, "effects": 0, "failed": 0,
    }  # fmt: skip
    assert results(cli.json("cleanup", "--failed-older-than", "1d"))["failed"] == 5
    assert counts(engine, s)["failed"] == 0
    # a second run finds nothing more
    assert cli.json("cleanup")["total"] == 0


def test_cleanup_rejects_a_bad_duration(fresh_schema: SchemaFactory) -> None:
    proc = Cli(fresh_schema())("cleanup", "--inbox-older-than", "soon")
    assert proc.returncode == 2
    assert "not a duration" in proc.stderr


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def wait_all_published(engine: Engine, s: OutboxSettings, log: Path) -> None:
    e = build_tables(s).events
    deadline = time.monotonic() + 60
    pending = -1
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            pending = conn.execute(
                select(func.count()).where(e.c.published_at.is_(None))
            ).scalar_one()
        if pending == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{pending} rows still pending; relay log:\n{tail(log)}")


async def test_cleanup_while_a_relay_runs(
    fresh_schema: SchemaFactory,
    acceptance_engine: Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    engine = acceptance_engine
    s = fresh_schema(keep_published_hours=1)
    topic = await new_topic(partitions=2)
    log = tmp_path / "relay.log"
    # The relay purges published rows itself every stats interval (first at start-up);
    # pushing the next run an hour away leaves the retention work to `outbox cleanup`.
    relay = Cli(s, extra_env=(("OUTBOX_RELAY__STATS_INTERVAL_SECONDS", "3600"),)).popen(
        "relay", log=log
    )
    try:
        old = publish(engine, s, topic, 500)
        await wait_all_published(engine, s, log)
        age_rows(engine, s, old, created="3 hours", published="2 hours")  # now past retention
        fresh: list[int] = []
        deleted = 0
        for _round in range(5):
            fresh += publish(engine, s, topic, 200)  # the relay publishes these meanwhile
            done = Cli(s).json("cleanup", "--batch-size", "50", "--no-idempotency")
            deleted += results(done)["events"]
        await wait_all_published(engine, s, log)
        assert relay.poll() is None, tail(log)
    finally:
        relay.send_signal(signal.SIGTERM)
        rc = relay.wait(30)
    assert rc == 0, tail(log)

    assert deleted == len(old)  # every old published row went, in bounded batches
    e = build_tables(s).events
    with engine.connect() as conn:
        remaining = set(conn.execute(select(e.c.id)).scalars())
    assert remaining == set(fresh)  # the rows the relay just published are all kept
    records = await read_all(kafka_bootstrap, topic, expect=len(old) + len(fresh))
    assert len({r.headers["ce_id"] for r in records}) == len(old) + len(fresh)  # none lost

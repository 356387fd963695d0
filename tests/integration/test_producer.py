"""The producer API against a real PostgreSQL: atomicity, duplicates, limits, errors."""

from __future__ import annotations

import uuid

import pytest
from pydantic import BaseModel
from sqlalchemy import Column, Engine, Integer, MetaData, Table, Text, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import (
    TOMBSTONE,
    InvalidIdentifier,
    Message,
    Outbox,
    OutboxSettings,
    PayloadError,
    PayloadMismatch,
    PayloadTooLarge,
    SchemaMissing,
    idempotency_key,
)
from outbox.testing import published

pytestmark = pytest.mark.integration

domain = MetaData()
orders = Table("orders", domain, Column("id", Integer, primary_key=True), Column("note", Text))


class OrderCreated(BaseModel):
    order_id: int
    total_cents: int


@pytest.fixture(scope="module")
def ob(settings: OutboxSettings, engine: Engine) -> Outbox:
    domain.create_all(engine)
    return Outbox(settings)


def _count(engine: Engine, ob: Outbox, topic: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count())
            .select_from(ob.tables.events)
            .where(ob.tables.events.c.topic == topic)
        ).scalar_one()


def _topic() -> str:
    return f"orders-{uuid.uuid4().hex[:8]}"


def test_publish_commits_with_domain_row(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=1001, note="x"))
        event_id = ob.publish(
            session,
            topic=topic,
            key="1001",
            event_type="order.created",
            payload=OrderCreated(order_id=1001, total_cents=990),
        )
    with engine.connect() as conn:
        row = conn.execute(
            select(ob.tables.events).where(ob.tables.events.c.event_id == event_id)
        ).one()
        assert conn.execute(select(orders.c.id).where(orders.c.id == 1001)).scalar_one() == 1001
    assert row.payload == b'{"order_id":1001,"total_cents":990}'
    assert row.content_type == "application/json"
    assert row.key == b"1001"
    assert row.topic == topic
    assert 0 <= row.lane < ob.settings.lanes
    assert row.attempts == 0 and row.published_at is None


def test_rollback_leaves_neither(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=1002, note="x"))
        ob.publish(session, topic=topic, event_type="order.created", payload={"id": 1002})
        session.rollback()
    assert _count(engine, ob, topic) == 0
    with engine.connect() as conn:
        assert conn.execute(select(orders.c.id).where(orders.c.id == 1002)).first() is None


def test_publish_on_core_connection(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    with engine.begin() as conn:
        ob.publish(conn, topic=topic, event_type="t", payload=b"\x00raw")
    with engine.connect() as conn:
        row = conn.execute(select(ob.tables.events).where(ob.tables.events.c.topic == topic)).one()
    assert row.payload == b"\x00raw" and row.content_type == "application/octet-stream"


async def test_async_session_and_connection(
    aengine: AsyncEngine, engine: Engine, ob: Outbox
) -> None:
    topic = _topic()
    async with AsyncSession(aengine) as session, session.begin():
        await session.execute(orders.insert().values(id=1003, note="async"))
        await ob.publish_async(session, topic=topic, event_type="t", payload={"n": 1}, key="k")
    async with aengine.begin() as conn:
        await ob.publish_many_async(
            conn, [Message(topic=topic, event_type="t", payload={"n": n}) for n in range(2, 5)]
        )
    async with AsyncSession(aengine) as session, session.begin():
        await ob.publish_async(session, topic=topic, event_type="t", payload={"n": 99})
        await session.rollback()
    assert _count(engine, ob, topic) == 4


def test_publish_many_10k_rows_is_one_statement(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    messages = [
        Message(topic=topic, event_type="t", key=f"k{n % 100}", payload={"n": n})
        for n in range(10_000)
    ]
    statements: list[str] = []

    from sqlalchemy import event

    def count(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if "INSERT" in statement:
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with Session(engine) as session, session.begin():
            ids = ob.publish_many(session, messages)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 1
    assert len(ids) == 10_000 and len(set(ids)) == 10_000
    with engine.connect() as conn:
        rows = conn.execute(
            select(ob.tables.events.c.id, ob.tables.events.c.payload)
            .where(ob.tables.events.c.topic == topic)
            .order_by(ob.tables.events.c.id)
        ).all()
    # ids follow the caller's order: the relay publishes a lane in id order.
    assert [r.payload for r in rows] == [f'{{"n":{n}}}'.encode() for n in range(10_000)]


def test_one_event_and_a_batch_store_the_same_row(engine: Engine, ob: Outbox) -> None:
    """``publish`` of one event uses a scalar INSERT, ``publish_many`` the unnest one; both
    must write identical rows."""
    topic = _topic()
    fields = {
        "topic": topic,
        "key": "cus-1",
        "event_type": "order.created",
        "payload": {"order_id": 1, "note": "ü"},
        "headers": {"traceparent": "00-abc-def-01"},
        "source": "urn:shop",
        "delay_seconds": 0.5,
    }
    one, two = uuid.uuid4(), uuid.uuid4()
    with Session(engine) as session, session.begin():
        ob.publish(session, event_id=one, **fields)  # type: ignore[arg-type]
        ob.publish_many(
            session,
            [Message(event_id=two, **fields), Message(topic=topic, event_type="x", payload={})],  # type: ignore[arg-type]
        )
    t = ob.tables.events
    compared = [c for c in t.c if c.name not in ("id", "event_id", "created_at", "available_at")]
    with engine.connect() as conn:
        rows = {
            r.event_id: r
            for r in conn.execute(
                select(
                    t.c.event_id, (t.c.available_at - t.c.created_at).label("delay"), *compared
                ).where(t.c.event_id.in_([one, two]))
            )
        }
    assert rows[one]._mapping.keys() == rows[two]._mapping.keys()
    assert {k: v for k, v in rows[one]._mapping.items() if k != "event_id"} == {
        k: v for k, v in rows[two]._mapping.items() if k != "event_id"
    }
    assert rows[one].delay.total_seconds() == pytest.approx(0.5, abs=0.05)


def test_duplicate_event_id_same_payload_is_a_noop(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    eid = idempotency_key("order", 7, "created")
    for _ in range(3):
        with Session(engine) as session, session.begin():
            assert (
                ob.publish(session, topic=topic, event_type="t", payload={"a": 1}, event_id=eid)
                == eid
            )
    assert _count(engine, ob, topic) == 1


def test_duplicate_event_id_different_payload_raises(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    eid = uuid.uuid4()
    with Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", payload={"a": 1}, event_id=eid)
    with pytest.raises(PayloadMismatch) as info, Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", payload={"a": 2}, event_id=eid)
    assert str(eid) in str(info.value)
    with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
        ob.publish_many(
            session,
            [
                Message(topic=topic, event_type="t", payload={"b": n}, event_id=uuid.UUID(int=5))
                for n in range(2)
            ],
        )
    assert _count(engine, ob, topic) == 1


def _payload(engine: Engine, ob: Outbox, event_id: uuid.UUID) -> bytes:
    with engine.connect() as conn:
        events = ob.tables.events
        return bytes(
            conn.execute(select(events.c.payload).where(events.c.event_id == event_id)).scalar_one()
        )


async def test_duplicate_event_id_with_reordered_json_is_a_noop(
    engine: Engine, aengine: AsyncEngine, ob: Outbox
) -> None:
    """Member order and 1 vs 1.0 are encoding, not content (RFC 8785 canonical form): the
    first encoding stays stored, every re-publish of the same JSON is a no-op."""
    topic = _topic()
    eid = uuid.uuid4()
    first = {"a": 1, "b": {"x": [1, 2], "y": "é"}}
    with Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", key="k", payload=first, event_id=eid)
    stored = _payload(engine, ob, eid)
    reordered = {"b": {"y": "é", "x": [1, 2]}, "a": 1.0}
    with Session(engine) as session, session.begin():
        again = ob.publish(
            session, topic=topic, event_type="t", key="k", payload=reordered, event_id=eid
        )
    assert again == eid
    async with AsyncSession(aengine) as asession, asession.begin():
        await ob.publish_async(
            asession, topic=topic, event_type="t", key="k", payload=reordered, event_id=eid
        )
    # Both orders inside one batch, for a new id and for the stored one.
    other = uuid.uuid4()
    with Session(engine) as session, session.begin():
        ids = ob.publish_many(
            session,
            [
                Message(topic=topic, event_type="t", key="k", payload=p, event_id=i)
                for i in (other, eid)
                for p in (reordered, first)
            ],
        )
    assert ids == [other, other, eid, eid]
    assert _count(engine, ob, topic) == 2
    assert _payload(engine, ob, eid) == stored == b'{"a":1,"b":{"x":[1,2],"y":"\xc3\xa9"}}'


async def test_duplicate_event_id_with_other_json_still_raises(
    engine: Engine, aengine: AsyncEngine, ob: Outbox
) -> None:
    topic = _topic()
    eid = uuid.uuid4()
    first = {"a": 1, "b": {"x": [1, 2]}}
    with Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", payload=first, event_id=eid)
    for changed in (
        {"b": {"x": [2, 1]}, "a": 1},  # array order is content
        {"b": {"x": [1, 2]}, "a": 2},
        {"b": {"x": [1, 2]}, "a": 1, "c": None},
    ):
        with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
            ob.publish(session, topic=topic, event_type="t", payload=changed, event_id=eid)
    reordered = {"b": {"x": [1, 2]}, "a": 1}
    with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="other", payload=reordered, event_id=eid)
    # Raw bytes are opaque: JSON text sent as bytes is compared byte for byte.
    raw = b'{"b":{"x":[1,2]},"a":1}'
    with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", payload=raw, event_id=eid)
    with pytest.raises(PayloadMismatch):
        async with AsyncSession(aengine) as asession, asession.begin():
            await ob.publish_async(
                asession, topic=topic, event_type="t", payload={"a": 3}, event_id=eid
            )
    assert _count(engine, ob, topic) == 1


def test_oversize_payload_rejected_and_nothing_written(
    engine: Engine, settings: OutboxSettings
) -> None:
    topic = _topic()
    small = Outbox(settings.model_copy(update={"max_payload_bytes": 1000}))
    with (
        pytest.raises(PayloadTooLarge, match="over the limit of 1000 bytes"),
        Session(engine) as session,
        session.begin(),
    ):
        small.publish(session, topic=topic, event_type="t", payload={"ok": 1})
        small.publish(session, topic=topic, event_type="t", payload=b"x" * 1001)
    assert _count(engine, small, topic) == 0
    default = Outbox(settings)
    with pytest.raises(PayloadTooLarge), Session(engine) as session, session.begin():
        default.publish(session, topic=topic, event_type="t", payload=b"x" * (1024 * 1024 + 1))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("topic", "bad topic!", "not a valid Kafka name"),
        ("topic", "", "not a valid Kafka name"),
        ("event_type", "", "event_type"),
        ("event_id", "not-a-uuid", "not a UUID"),
        ("headers", {"ce_id": "x"}, "reserved"),
        ("payload", {1, 2}, "payload must be"),
        ("payload", {"when": object()}, "not JSON-serializable"),
    ],
)
def test_bad_input_rejected(
    engine: Engine, ob: Outbox, field: str, value: object, match: str
) -> None:
    kwargs: dict[str, object] = {"topic": "orders", "event_type": "t", "payload": {"a": 1}}
    kwargs[field] = value
    with (
        pytest.raises((PayloadError, InvalidIdentifier), match=match),
        Session(engine) as session,
        session.begin(),
    ):
        ob.publish(session, **kwargs)  # type: ignore[arg-type]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"total": NAN}, "$.total is NaN"),
        ({"total": INF}, "$.total is Infinity"),
        ({"order": {"lines": [{"price": 1.0}, {"price": -INF}]}}, "$.order.lines[1].price"),
        ([0.5, [1.5, NAN]], "$[1][1] is NaN"),
    ],
)
async def test_nan_and_infinity_are_refused_before_anything_is_written(
    engine: Engine, aengine: AsyncEngine, ob: Outbox, payload: object, where: str
) -> None:
    topic = _topic()
    good = Message(topic=topic, key="k", event_type="t", payload={"total": 1.5})
    bad = Message(topic=topic, key="k", event_type="t", payload=payload)  # type: ignore[arg-type]
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=abs(hash(topic)) % 10**9, note="kept"))
        with pytest.raises(PayloadError, match="no JSON representation") as info:
            ob.publish(session, topic=topic, event_type="t", payload=payload)  # type: ignore[arg-type]
        assert f"payload {where}" in str(info.value)
        # One bad message in a batch: none of the batch is written.
        with pytest.raises(PayloadError, match="no JSON representation"):
            ob.publish_many(session, [good, bad, good])
        # The caller's transaction is untouched and commits its own rows.
    async with AsyncSession(aengine) as asession, asession.begin():
        with pytest.raises(PayloadError, match="no JSON representation"):
            await ob.publish_async(asession, topic=topic, event_type="t", payload=payload)  # type: ignore[arg-type]
        with pytest.raises(PayloadError, match="no JSON representation"):
            await ob.publish_many_async(asession, [good, bad])
    assert _count(engine, ob, topic) == 0
    with engine.connect() as conn:
        notes = conn.execute(select(orders.c.note).where(orders.c.note == "kept")).scalars()
        assert "kept" in list(notes)


def test_a_tombstone_is_stored_as_null_payload_in_the_keys_lane(
    engine: Engine, ob: Outbox, settings: OutboxSettings
) -> None:
    topic = _topic()
    events = ob.tables.events
    with Session(engine) as session, session.begin():
        created = ob.publish(session, topic=topic, key="c-1", event_type="c.up", payload={"v": 1})
        # One statement with a JSON payload, raw bytes and a tombstone side by side.
        ids = ob.publish_many(
            session,
            [
                Message(topic=topic, key="c-1", event_type="c.up", payload={"v": 2}),
                Message(topic=topic, key="c-2", event_type="c.up", payload=b"raw"),
                Message(topic=topic, key="c-1", event_type="c.deleted", payload=TOMBSTONE),
            ],
        )
        # A batch of tombstones only (every array element NULL) and a single one.
        only = ob.publish_many(
            session, [Message(topic=topic, key="c-3", event_type="c.deleted", payload=TOMBSTONE)]
        )
        single = ob.publish(
            session, topic=topic, key="c-4", event_type="c.deleted", payload=TOMBSTONE
        )
        seen = published(session, settings, topic)
    assert [e.event_id for e in seen] == [created, *ids, *only, single]
    assert [e.is_tombstone for e in seen] == [False, False, False, True, True, True]
    assert seen[3].json() is None and seen[0].json() == {"v": 1}
    with engine.connect() as conn:
        rows = conn.execute(
            select(events.c.event_id, events.c.payload, events.c.content_type, events.c.lane)
            .where(events.c.topic == topic)
            .order_by(events.c.id)
        ).all()
    assert [(r.payload, r.content_type) for r in rows] == [
        (b'{"v":1}', "application/json"),
        (b'{"v":2}', "application/json"),
        (b"raw", "application/octet-stream"),
        (None, None),
        (None, None),
        (None, None),
    ]
    assert rows[3].lane == rows[0].lane  # the key's lane: ordered after its updates

    # Publishing the same tombstone again is a no-op; its id with a payload is a mismatch.
    deleted = ids[2]
    with Session(engine) as session, session.begin():
        again = Message(
            topic=topic, key="c-1", event_type="c.deleted", payload=TOMBSTONE, event_id=deleted
        )
        assert ob.publish_many(session, [again]) == [deleted]
    with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
        ob.publish(
            session, topic=topic, key="c-1", event_type="c.deleted", payload={}, event_id=deleted
        )
    with pytest.raises(PayloadMismatch), Session(engine) as session, session.begin():
        ob.publish(
            session, topic=topic, key="c-1", event_type="c.up", payload=TOMBSTONE, event_id=created
        )
    assert _count(engine, ob, topic) == 6


def test_none_and_keyless_tombstones_are_refused(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    with Session(engine) as session, session.begin():
        with pytest.raises(PayloadError, match=r"payload=outbox\.TOMBSTONE"):
            ob.publish(session, topic=topic, key="c-1", event_type="c.deleted", payload=None)  # type: ignore[arg-type]
        with pytest.raises(PayloadError, match="needs a key"):
            ob.publish(session, topic=topic, event_type="c.deleted", payload=TOMBSTONE)
    assert _count(engine, ob, topic) == 0


def test_missing_tables_name_the_upgrade_command(engine: Engine, settings: OutboxSettings) -> None:
    unmigrated = Outbox(settings.model_copy(update={"table_prefix": "never_migrated_"}))
    with (
        pytest.raises(SchemaMissing, match="outbox db upgrade"),
        Session(engine) as session,
        session.begin(),
    ):
        unmigrated.publish(session, topic="orders", event_type="t", payload={})


def test_delay_sets_available_at(engine: Engine, ob: Outbox) -> None:
    topic = _topic()
    with Session(engine) as session, session.begin():
        ob.publish(session, topic=topic, event_type="t", payload={}, delay_seconds=3600)
    with engine.connect() as conn:
        delay = conn.execute(
            text(
                "SELECT extract(epoch FROM available_at - created_at) "
                f"FROM {ob.tables.events.fullname} WHERE topic = :t"
            ),
            {"t": topic},
        ).scalar_one()
    assert 3599 <= float(delay) <= 3601

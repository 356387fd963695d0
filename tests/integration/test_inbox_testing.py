"""inbox.testing's harness runs the real processing path: retries with durable attempt
counts, classification, dead letters, duplicates, the stale guard, EventContext."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import EventContext, InboxEvent, Permanent, Retryable
from inbox.envelopes import Debezium
from inbox.testing import InboxHarness, Record
from outbox import TOMBSTONE, Outbox
from outbox.settings import OutboxSettings
from outbox.testing import published

pytestmark = pytest.mark.integration


class Job(BaseModel):
    fail_times: int = 0
    permanent: bool = False


def _app(seen: list[EventContext]) -> inbox.Consumer:
    app = inbox.Consumer(name=f"harness-{uuid.uuid4().hex[:8]}", topics=["jobs"])

    @app.handler("job.run", max_attempts=3)
    async def run(job: Job, session: AsyncSession, ctx: EventContext) -> None:
        seen.append(ctx)
        if job.permanent:
            raise Permanent("cannot run this job")
        if ctx.attempt <= job.fail_times:
            raise Retryable("worker busy")

    @app.handler("job.versioned", stale="skip")
    async def versioned(job: Job, session: AsyncSession) -> None: ...

    return app


async def test_retries_count_attempts_and_then_succeed(settings: OutboxSettings) -> None:
    seen: list[EventContext] = []
    async with InboxHarness(_app(seen), settings) as harness:
        delivery = await harness.deliver("job.run", Job(fail_times=2), key="j1")
    assert (delivery.outcome, delivery.runs) == ("handled", 3)
    assert [c.attempt for c in seen] == [1, 2, 3]
    assert {(c.event_id, c.key, c.topic, c.partition) for c in seen} == {
        (delivery.event.event_id, b"j1", "jobs", 0)
    }
    assert seen[0].header("ce_type") == "job.run"


async def test_exhausted_retries_and_permanent_errors_are_dead_lettered(
    settings: OutboxSettings,
) -> None:
    seen: list[EventContext] = []
    async with InboxHarness(_app(seen), settings) as harness:
        exhausted = await harness.deliver("job.run", Job(fail_times=5))
        permanent = await harness.deliver("job.run", Job(permanent=True))
        assert await harness.status(permanent.event) == "dead_lettered"
        again = await harness.deliver(permanent.event)
    assert exhausted.outcome == "dead_lettered" and exhausted.dead_letter is not None
    assert (exhausted.dead_letter.error_class, exhausted.dead_letter.attempts) == ("Retryable", 3)
    assert permanent.dead_letter is not None
    assert (permanent.dead_letter.error_class, permanent.dead_letter.attempts) == ("Permanent", 1)
    assert permanent.dead_letter.error_message == "cannot run this job"
    assert again.outcome == "duplicate"  # a dead letter is not dead-lettered twice
    assert [d.event_id for d in harness.dead_letters] == [
        exhausted.event.event_id,
        permanent.event.event_id,
    ]


async def test_stale_events_and_unknown_types_follow_the_policies(
    settings: OutboxSettings,
) -> None:
    async with InboxHarness(_app([]), settings) as harness:  # unknown types: skip by default
        key = f"k-{uuid.uuid4().hex[:6]}"
        newer = await harness.deliver("job.versioned", Job(), key=key, sequence=5)
        older = await harness.deliver("job.versioned", Job(), key=key, sequence=4)
        unknown = await harness.deliver("job.unknown", Job())
    assert (newer.outcome, older.outcome, unknown.outcome) == ("handled", "stale", "skipped")
    assert harness.dead_letters == []
    dead_letter_unknown = settings.model_copy(
        update={
            "consumer": settings.consumer.model_copy(update={"unknown_type_policy": "dead_letter"})
        }
    )
    async with InboxHarness(_app([]), dead_letter_unknown) as harness:
        asked = await harness.deliver("job.unknown", Job())
    assert asked.outcome == "dead_lettered"


class Order(BaseModel):
    order_id: int


def _debezium_app(seen: list[EventContext]) -> inbox.Consumer:
    """Events without a type (Debezium's outbox router by default), routed by topic."""
    app = inbox.Consumer(
        name=f"harness-{uuid.uuid4().hex[:8]}",
        topics=["outbox.event.order"],
        envelope=Debezium(sequence_header="version"),
    )

    @app.handler(topic="outbox.event.order", max_attempts=2, stale="skip")
    async def on_order(order: Order, session: AsyncSession, ctx: EventContext) -> None:
        seen.append(ctx)
        if order.order_id < 0:
            raise Retryable("inventory busy")

    return app


async def test_topic_handlers_get_retries_dead_letters_the_guard_and_context(
    settings: OutboxSettings,
) -> None:
    seen: list[EventContext] = []
    async with InboxHarness(_debezium_app(seen), settings) as harness:

        def order(event_id: str, order_id: int, version: int) -> Record:
            payload = json.dumps(json.dumps({"order_id": order_id}))  # the router's string
            headers = {"id": event_id, "version": str(version)}
            return harness.record(payload.encode(), key="o1", headers=headers)

        first = await harness.deliver(order("e1", 1, 1))
        duplicate = await harness.deliver(order("e1", 1, 1))  # a second copy, another offset
        stale = await harness.deliver(order("e0", 1, 1))  # an older version of key o1
        retried = await harness.deliver(order("e2", -1, 2))  # fails twice: dead-lettered
        unreadable = await harness.deliver(harness.record(b"{}", key="o1"))  # no id header
        invalid = await harness.deliver(
            dataclasses.replace(order("e3", 1, 3), value=b'{"order_id": "x"}')
        )
    assert (first.outcome, first.event.event_id, first.event.event_type) == ("handled", "e1", None)
    assert seen[0].attempt == 1 and seen[0].key == b"o1" and seen[0].sequence == 1
    assert duplicate.outcome == "duplicate" and stale.outcome == "stale"
    assert retried.outcome == "dead_lettered" and retried.runs == 2
    assert retried.dead_letter is not None and retried.dead_letter.event_id == "e2"
    assert unreadable.outcome == "dead_lettered" and unreadable.dead_letter is not None
    assert unreadable.dead_letter.error_class == "MalformedRecord"
    assert unreadable.dead_letter.error_message == "debezium: no 'id' header with the event id"
    assert invalid.dead_letter is not None and invalid.dead_letter.error_class == "ValidationError"
    # Dead letters carry the record as the producer wrote it, not the unwrapped payload.
    assert retried.dead_letter.value == json.dumps(json.dumps({"order_id": -1})).encode()


class Profile(BaseModel):
    name: str


async def test_tombstones_reach_handlers_that_take_them_and_dead_letter_the_others(
    settings: OutboxSettings, engine: Engine
) -> None:
    got: list[tuple[str, object]] = []
    app = inbox.Consumer(name=f"harness-{uuid.uuid4().hex[:8]}", topics=["profiles"])

    @app.handler("profile.state")
    async def state(profile: Profile | None, session: AsyncSession, ctx: EventContext) -> None:
        got.append(("state", profile if profile is None else profile.name))

    @app.handler("profile.raw")
    async def raw(event: InboxEvent, session: AsyncSession) -> None:
        got.append(("raw", event.value))

    @app.handler("profile.strict")
    async def strict(profile: Profile, session: AsyncSession) -> None:
        got.append(("strict", profile.name))

    async with InboxHarness(app, settings) as harness:
        ada = await harness.deliver("profile.state", Profile(name="Ada"), key="p-1")
        gone = await harness.deliver("profile.state", TOMBSTONE, key="p-1")
        raw_gone = await harness.deliver("profile.raw", TOMBSTONE, key="p-1")
        refused = await harness.deliver("profile.strict", TOMBSTONE, key="p-1")
        # A tombstone a unit of work published, delivered as the relay would.
        ob = Outbox(settings)
        with Session(engine) as session, session.begin():
            ob.publish(
                session, topic="profiles", key="p-2", event_type="profile.state", payload=TOMBSTONE
            )
            [published_tombstone] = [
                e for e in published(session, settings, "profiles") if e.key == "p-2"
            ]
            session.rollback()
        from_outbox = await harness.deliver(published_tombstone)
    assert [d.outcome for d in (ada, gone, raw_gone, from_outbox)] == ["handled"] * 4
    assert got == [("state", "Ada"), ("state", None), ("raw", None), ("state", None)]
    assert gone.event.value is None and gone.event.content_type is None
    assert refused.outcome == "dead_lettered" and refused.dead_letter is not None
    assert refused.dead_letter.error_class == "TombstoneRefused"
    assert "Profile | None" in refused.dead_letter.error_message
    assert refused.dead_letter.value is None and refused.dead_letter.key == b"p-1"

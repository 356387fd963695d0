"""The handler registry: typed handlers, topic handlers for events without a type, and
declarations that could claim one record twice (refused when declared)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

import inbox
from inbox.envelopes import Generic, Header


class Thing(BaseModel):
    n: int


async def h1(event: Thing, session: object) -> None: ...
async def h2(event: Thing, session: object) -> None: ...


def app(**kw: object) -> inbox.Consumer:
    return inbox.Consumer(
        name="c",
        topics=["ce", "dbz", "json"],
        envelopes={"dbz": "debezium"},
        **kw,  # type: ignore[arg-type]
    )


def test_each_topic_routes_through_its_own_table() -> None:
    a = app()
    a.handler("order.created")(h1)
    a.handler(topic="dbz")(h2)
    a.handler("order.paid", topic="json")(h2)
    assert a.router("ce")("order.created").fn is h1  # type: ignore[union-attr]
    assert a.router("ce")("order.paid") is None and a.router("ce")(None) is None
    assert a.router("dbz")(None).fn is h2  # type: ignore[union-attr]
    assert a.router("json")("order.paid").fn is h2  # type: ignore[union-attr]
    assert a.envelope_for("dbz").name == "debezium" and a.envelope_for("ce").name == "cloudevents"
    assert a.decoder("dbz") == a.envelope_for("dbz").decode


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        ({"event_type": "a"}, {"event_type": "a"}, "type 'a' already has handler"),
        ({"topic": "dbz"}, {"topic": "dbz"}, "already has handler"),
        (
            {"event_type": "a"},
            {"event_type": "a", "topic": "ce"},
            "could both claim a record of topic 'ce'",
        ),
        ({"event_type": "a"}, {"topic": "ce"}, "could both claim"),  # CloudEvents are typed
        ({"topic": "json"}, {"event_type": "z", "topic": "json"}, "could both claim"),
    ],
)
def test_two_handlers_that_could_claim_one_record_are_refused(
    first: dict[str, str], second: dict[str, str], match: str
) -> None:
    a = app()
    a.handler(**first)(h1)  # type: ignore[arg-type]
    with pytest.raises(inbox.HandlerConfigurationError, match=match):
        a.handler(**second)(h2)  # type: ignore[arg-type]


def test_a_topic_handler_next_to_typed_handlers_of_other_topics_is_fine() -> None:
    a = app()
    a.handler("a")(h1)  # typed: on ce and json (Debezium without a type header yields none)
    a.handler(topic="dbz")(h2)
    typed = inbox.Consumer(
        name="c", topics=["x"], envelope=Generic(id=Header("i"), type=Header("t"))
    )
    typed.handler(topic="x")(h1)  # a topic handler alone takes every record, typed or not
    assert typed.router("x")("anything").fn is h1  # type: ignore[union-attr]


def test_declarations_that_can_never_match_are_refused() -> None:
    untyped = inbox.Consumer(name="c", topics=["dbz"], envelope="debezium")
    with pytest.raises(inbox.HandlerConfigurationError, match="would never run"):
        untyped.handler("order.created")(h1)
    with pytest.raises(inbox.HandlerConfigurationError, match="not one of this consumer's"):
        untyped.handler(topic="elsewhere")(h1)
    with pytest.raises(inbox.HandlerConfigurationError, match="needs an event type, a topic"):
        untyped.handler()(h1)
    with pytest.raises(inbox.HandlerConfigurationError, match="topics the consumer does not read"):
        inbox.Consumer(name="c", topics=["a"], envelopes={"b": "debezium"})

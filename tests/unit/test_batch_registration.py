"""Declaring batch handlers: what the signature must be, and the typed errors otherwise;
which calls a transaction makes (``groups``) and which item an error names (``pinned``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import EventContext, HandlerConfigurationError, InboxEvent, Permanent, Retryable
from inbox.dispatch import pinned
from inbox.transaction import groups
from outbox.errors import ConfigurationError


class Order(BaseModel):
    n: int


def app() -> inbox.Consumer:
    return inbox.Consumer(name="c", topics=["orders"])


def test_a_list_of_models_is_parsed_per_item() -> None:
    a = app()

    @a.handler("order.created", batch=True, max_batch=50)
    async def project(orders: list[Order], session: AsyncSession) -> None: ...

    handler = a.handlers["order.created"]
    assert (handler.batch, handler.model, handler.max_batch, handler.wants_context) == (
        True,
        Order,
        50,
        False,
    )
    assert handler.batch_limit(500) == 50


def test_raw_events_sequences_contexts_tombstones_and_sync_functions() -> None:
    a = app()

    @a.handler("raw", batch=True)
    def raw(events: Sequence[InboxEvent], session: Session, ctx: list[EventContext]) -> None: ...

    @a.handler("deleted", batch=True)
    async def deleted(orders: list[Order | None], session: AsyncSession) -> None: ...

    assert a.handlers["raw"].model is None
    assert a.handlers["raw"].wants_context and not a.handlers["raw"].is_async
    assert a.handlers["raw"].batch_limit(500) == 500  # the settings' default
    assert a.handlers["deleted"].takes_tombstones


def test_a_per_event_handler_is_a_batch_of_one_for_the_grouping() -> None:
    a = app()

    @a.handler("one")
    async def one(order: Order, session: AsyncSession) -> None: ...

    assert a.handlers["one"].batch_limit(500) == 1


@pytest.mark.parametrize(
    ("options", "fn", "says"),
    [
        ({"batch": True}, lambda order, session: None, "must take a list first"),
        ({}, "list_first", "declare it with batch=True"),
        ({"batch": True}, "list_of_ints", "must be a pydantic model or InboxEvent"),
        ({"batch": True}, "single_context", "list[EventContext]"),
        ({"batch": True, "max_batch": 0}, "ok", "max_batch must be a whole number"),
        ({"batch": True, "max_batch": True}, "ok", "max_batch must be a whole number"),
        ({"max_batch": 10}, "ok", "max_batch is for batch handlers"),
        ({"batch": True}, "one_parameter", "must accept (events, session)"),
        ({"batch": True}, "extra_required", "any others need defaults"),
    ],
)
def test_bad_declarations_are_refused_with_a_typed_error(
    options: dict[str, Any], fn: Any, says: str
) -> None:
    async def list_first(orders: list[Order], session: AsyncSession) -> None: ...

    async def list_of_ints(ns: list[int], session: AsyncSession) -> None: ...

    async def single_context(o: list[Order], s: AsyncSession, ctx: EventContext) -> None: ...

    async def one_parameter(orders: list[Order]) -> None: ...

    async def extra_required(orders: list[Order], session: AsyncSession, x: int) -> None: ...

    fns = {
        "list_first": list_first,
        "list_of_ints": list_of_ints,
        "single_context": single_context,
        "one_parameter": one_parameter,
        "extra_required": extra_required,
        "ok": list_first,
    }
    with pytest.raises(HandlerConfigurationError, match=re.escape(says)) as caught:
        app().handler("order.created", **options)(fns.get(fn, fn) if isinstance(fn, str) else fn)
    assert isinstance(caught.value, ConfigurationError)


def _event(n: int, event_type: str = "order.created", partition: int = 0) -> InboxEvent:
    return InboxEvent(
        event_id=f"e{partition}-{n}",
        event_type=event_type,
        topic="orders",
        partition=partition,
        offset=n,
        key=b"k",
        value=b"{}",
        headers=(),
    )


class _Routed:
    """What ``groups`` asks of a member's dispatch: its routing (event type -> handler)."""

    def __init__(self, a: inbox.Consumer) -> None:
        self.route = a.handlers.get


def test_groups_join_consecutive_events_of_a_batch_handler_across_partitions() -> None:
    a = app()

    @a.handler("order.created", batch=True, max_batch=3)
    async def project(orders: list[Order], session: AsyncSession) -> None: ...

    @a.handler("order.paid")
    async def paid(order: Order, session: AsyncSession) -> None: ...

    p0, p1 = _Routed(a), _Routed(a)
    run0 = [_event(0), _event(1), _event(2, "order.paid"), _event(3), _event(4)]
    run1 = [_event(0, partition=1), _event(1, partition=1), _event(2, partition=1)]
    duplicate = run1[1]
    fresh = {e.event_id for e in run0 + run1} - {duplicate.event_id}
    unique = {e.event_id: e for e in run0 + run1}
    members: Any = [(p0, run0), (p1, run1)]
    calls = [
        (h.fn.__name__, [(m, i) for m, i, _, _ in group])
        for h, group in groups(members, fresh, unique, 500)
    ]
    # The duplicate is left out; the max_batch of 3 cuts the second list.
    assert calls == [
        ("project", [(0, 0), (0, 1)]),
        ("paid", [(0, 2)]),
        ("project", [(0, 3), (0, 4), (1, 0)]),
        ("project", [(1, 2)]),
    ]


def test_pinned_finds_the_item_an_error_names() -> None:
    events = [_event(n) for n in range(3)]
    args = [Order(n=n) for n in range(3)]
    contexts = [EventContext.of(e, 1) for e in events]
    assert pinned(Permanent("bad", event=args[1]), events, args, None) == 1
    assert pinned(Retryable("busy", event=contexts[2]), events, args, contexts) == 2
    assert pinned(Permanent("bad", event=_event(0)), events, args, None) == 0  # same id
    assert pinned(Permanent("bad"), events, args, None) is None
    assert pinned(Permanent("bad", event=Order(n=1)), events, args, None) is None
    assert pinned(ValueError("x"), events, args, None) is None

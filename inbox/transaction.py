"""The fast path's transaction: one partition's run, or the short runs of several.

One transaction per run (or for a shared transaction's runs), on a connection kept open
between transactions: all inbox rows claimed in one statement (which also opens the
transaction, BEGIN riding in its round trip), handlers run one after another in a session
bound to that connection, one commit (:func:`transaction`). If anything raises, the
transaction is rolled back (:class:`RolledBack`) and the partition's processor takes it
from there (the careful path, ``inbox/careful.py``).

The shared transaction of several partitions' short runs is ``inbox/together.py``.

Batch handlers (``@app.handler(..., batch=True)``): a transaction calls one with each run
of consecutive new events it takes (:func:`groups`: across the members, in offset order
per partition, up to its ``max_batch``). A failed call is pinned on one event only when
the failure says which (see :meth:`inbox.dispatch.Dispatch.run_batch`); otherwise it is
like a failure at the final flush, and the careful path splits the call to find it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence

from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncSession

from inbox.app import Handler
from inbox.connections import Connections, Held
from inbox.dispatch import Blame, Dispatch
from inbox.event import InboxEvent
from inbox.store import Arm
from outbox.db import unavailable
from outbox.dberrors import is_outage

log = logging.getLogger("outbox.inbox")


class RolledBack(Exception):
    """The fast transaction failed and was rolled back (internal control flow).

    ``at`` is the member (its position in the transaction's members) and the event in its
    run whose handler raised, or None when the failure cannot be pinned on one event (the
    claim, or the final flush of the handlers' writes, or the commit).
    """

    def __init__(self, at: tuple[int, int] | None, cause: Exception) -> None:
        super().__init__(at)
        self.at = at
        self.cause = cause


async def transaction(
    connections: Connections,
    members: Sequence[tuple[Dispatch, Sequence[InboxEvent]]],
    arm: Sequence[Arm],
) -> tuple[set[str], dict[str, InboxEvent]]:
    """One transaction for the members' runs: claim every event (arming ``arm`` in the same
    statement), run the handlers of the new ones, each member's in offset order, commit.

    Returns the new event ids and the copy of each id that was claimed (the same event
    twice, in one fetch or in two partitions: only the first copy runs). Anything failing
    rolls the transaction back and raises :class:`RolledBack`.
    """
    lead = members[0][0]
    unique: dict[str, InboxEvent] = {}
    for _, run in members:
        for event in run:
            unique.setdefault(event.event_id, event)
    held = await connections.take()
    session: AsyncSession | None = None
    at: tuple[int, int] | None = None
    try:
        try:
            fresh = await lead.store.begin_and_claim(
                held.raw, lead.consumer, list(unique.values()), arm=arm
            )
            session = AsyncSession(bind=held.sa, expire_on_commit=False)
            for handler, group in groups(members, fresh, unique, lead.config.handler_max_batch):
                if not handler.batch:
                    ((m, i, d, event),) = group
                    at = (m, i)
                    await d.run_handler(event, session, raw=held.raw)
                    continue
                # A failed call is pinned on one event only when the handler (or the
                # parsing of one event) says which: else the split finds it (careful.py).
                at, blame = None, Blame()
                try:
                    await lead.run_batch(handler, [e for *_, e in group], session, held.raw, blame)
                except Exception:
                    if blame.index is not None:
                        at = group[blame.index][:2]
                    raise
            at = None
            await _commit(held, session)
        except Exception as exc:
            log.debug("transaction failed", extra={"error": type(exc).__name__})
            await _rollback(held, session)
            if is_outage(exc):
                # The database cannot work right now, whoever met it (a handler's own
                # INSERT on a full disk included): no event is to blame, none is charged.
                raise unavailable(exc) from exc
            raise RolledBack(at, exc) from exc
    finally:
        await connections.give(held)
    lead.metrics.transactions()
    return fresh, unique


# One step of a transaction: a handler and the events of one call (one event, unless it is
# a batch handler), each with its member's position, the event's in its run, its dispatch.
Placed = tuple[int, int, Dispatch, InboxEvent]


def groups(
    members: Sequence[tuple[Dispatch, Sequence[InboxEvent]]],
    fresh: Collection[str],
    unique: dict[str, InboxEvent],
    max_batch: int,
) -> Iterator[tuple[Handler, list[Placed]]]:
    """The calls a transaction makes, in order: each new event of a per-event handler
    alone; consecutive new events of one batch handler together (across members: the
    list stays in offset order per partition), up to its ``max_batch``."""
    # Runs once per event of every transaction: kept to lookups and one append.
    group: list[Placed] = []
    current: Handler | None = None
    limit = 0
    for m, (d, run) in enumerate(members):
        route = d.route
        for i, event in enumerate(run):
            event_id = event.event_id
            if event_id not in fresh or unique[event_id] is not event:
                continue
            handler = route(event.event_type)
            if handler is not current or len(group) >= limit:
                assert handler is not None  # runs with events needing a policy are not fast
                if current is not None:
                    yield current, group
                group, current, limit = [], handler, handler.batch_limit(max_batch)
            group.append((m, i, d, event))
    if current is not None:
        yield current, group


async def _commit(held: Held, session: AsyncSession) -> None:
    """Flush the handlers' writes (their errors surface here) and commit.

    When the handlers used the session, SQLAlchemy began its own transaction on the
    connection (no BEGIN is sent in autocommit mode: it joined the server's, opened by the
    claim), and its commit sends COMMIT. Otherwise nothing of SQLAlchemy's is open, its
    commit does nothing, and the COMMIT goes straight to the driver.
    """
    await session.commit()
    if held.raw.info.transaction_status != TransactionStatus.IDLE:
        await held.raw.commit()


async def _rollback(held: Held, session: AsyncSession | None) -> None:
    """Roll back after a failure; a connection this leaves unclean is closed when given
    back (see inbox/connections.py)."""
    with contextlib.suppress(Exception):
        if session is not None and held.sa.in_transaction():
            await session.rollback()
        if not held.raw.broken and held.raw.info.transaction_status != TransactionStatus.IDLE:
            await held.raw.rollback()

"""Calling a partition's handlers: routing by event type, the stale guard, a batch
handler's list and which of its events a failure belongs to.

:class:`Dispatch` runs a handler inside a transaction its caller opened and commits (the
fast path's, ``inbox/transaction.py``, or the careful path's, ``inbox/careful.py``); it
writes no marker and decides nothing about failures beyond naming the event they belong
to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from inbox import failures, tracing
from inbox.app import Consumer, Handler
from inbox.context import EventContext
from inbox.event import InboxEvent
from inbox.metrics import Metrics
from inbox.store import Driver, InboxStore
from outbox.resilience.classify import Permanent, Retryable
from outbox.settings import ConsumerSettings

log = logging.getLogger("outbox.inbox")


@dataclass
class Blame:
    """Which event of a batch handler's list a failure belongs to (None: not known)."""

    index: int | None = None


@dataclass
class Dispatch:
    """One partition's handlers (its topic's routing table), called in a given session."""

    app: Consumer
    config: ConsumerSettings
    store: InboxStore
    metrics: Metrics
    topic: str
    # This partition's routing table (type -> handler), resolved once.
    route: Callable[[str | None], Handler | None] = field(init=False)

    def __post_init__(self) -> None:
        self.route = self.app.router(self.topic)

    @property
    def consumer(self) -> str:
        return self.app.name

    def handler(self, event: InboxEvent) -> Handler | None:
        return self.route(event.event_type)

    def needs_policy(self, event: InboxEvent) -> bool:
        """Whether the event has no handler to run (malformed, or no handler for its type):
        the consumer's policy for those decides (dead letter or skip)."""
        return event.malformed is not None or self.handler(event) is None

    def max_attempts(self, event: InboxEvent) -> int:
        handler = self.handler(event)
        if handler is not None and handler.max_attempts is not None:
            return handler.max_attempts
        return self.config.max_attempts

    def group_at(
        self, chunk: Sequence[InboxEvent], index: int, handler: Handler
    ) -> Sequence[InboxEvent]:
        """The events of one call of batch ``handler`` starting at ``chunk[index]``."""
        end = index + 1
        limit = index + handler.batch_limit(self.config.handler_max_batch)
        while (
            end < min(len(chunk), limit)
            and not self.needs_policy(chunk[end])
            and self.handler(chunk[end]) is handler
        ):
            end += 1
        return chunk[index:end]

    async def run_handler(
        self,
        event: InboxEvent,
        session: AsyncSession,
        attempt: int = 1,
        raw: Driver | None = None,
    ) -> None:
        """Run the event's handler in ``session``'s transaction (``raw``: the psycopg
        connection under it, when the caller has it at hand)."""
        handler = self.handler(event)
        assert handler is not None
        if handler.stale is not None and await self._stale(event, raw or session):
            return
        started = time.perf_counter()
        try:
            with tracing.process(event, self.consumer, attempt):
                await handler(event, session, attempt)
        except BaseException as exc:  # the success path pays one jump, no call
            failures.ran_for(exc, time.perf_counter() - started)
            raise
        finally:
            self.metrics.handler_seconds(time.perf_counter() - started)
        if handler.batch:
            self.metrics.batch_size(1)

    async def run_batch(
        self,
        handler: Handler,
        events: Sequence[InboxEvent],
        session: AsyncSession,
        raw: Driver | None,
        blame: Blame,
    ) -> None:
        """One call of a batch handler with the new ``events`` (their first attempt; the
        stale ones left out) in ``session``'s transaction. When it raises, ``blame`` says
        which event failed if that is known: its sequence was unreadable or its parsing
        failed, or the handler named it (``Permanent(..., event=item)``). The stale checks
        of the list are one statement (:meth:`InboxStore.advance_sequences`), whose
        failure no event is blamed for."""
        kept: Sequence[InboxEvent] = events
        args: list[object] = []
        parse = handler.parse
        if handler.stale is None:
            try:
                for event in events:
                    args.append(parse(event))
            except Exception:
                blame.index = len(args)  # the event whose payload failed to parse
                raise
        else:
            # The stale checks of the whole list in one statement (not one per event).
            guarded: list[int] = []  # the events with a sequence and a key
            items: list[tuple[bytes, int]] = []
            for k, event in enumerate(events):
                blame.index = k
                sequence = event.sequence  # InvalidSequence: this event's failure
                if sequence is not None and event.key is not None:
                    guarded.append(k)
                    items.append((event.key, sequence))
            blame.index = None
            current = await self.store.advance_sequences(raw or session, self.consumer, items)
            stale = {k for k, ok in zip(guarded, current, strict=True) if not ok}
            kept = []
            for k, event in enumerate(events):
                if k in stale:
                    self._skipped_stale(event)
                    continue
                blame.index = k
                args.append(parse(event))
                kept.append(event)
            blame.index = None
        if not kept:
            return
        contexts = [EventContext.of(e, 1) for e in kept] if handler.wants_context else None
        started = time.perf_counter()
        try:
            with tracing.batch(kept, self.consumer):
                await handler.call_batch(kept, args, session, contexts)
        except Exception as exc:
            failures.ran_for(exc, time.perf_counter() - started)
            # A list of one is that event's failure, named or not.
            pinned_at = 0 if len(kept) == 1 else pinned(exc, kept, args, contexts)
            if pinned_at is not None:
                blame.index = events.index(kept[pinned_at])
            raise
        finally:
            self.metrics.handler_seconds(time.perf_counter() - started)
        self.metrics.batch_size(len(kept))

    async def _stale(self, event: InboxEvent, db: AsyncSession | Driver) -> bool:
        """True when the event's sequence is not above the one applied for its key (the
        guard's check and advance are one statement in the handler's transaction)."""
        sequence = event.sequence  # InvalidSequence: permanent, dead-lettered
        if sequence is None or event.key is None:
            return False
        if await self.store.advance_sequence(db, self.consumer, event.key, sequence):
            return False
        self._skipped_stale(event)
        return True

    def _skipped_stale(self, event: InboxEvent) -> None:
        self.metrics.stale()
        log.debug(
            "stale event skipped", extra={"event_id": event.event_id, "sequence": event.sequence}
        )


def pinned(
    exc: Exception,
    events: Sequence[InboxEvent],
    args: Sequence[object],
    contexts: Sequence[EventContext] | None,
) -> int | None:
    """The index of the item a ``Permanent``/``Retryable`` raised with ``event=`` names:
    the parsed item, the InboxEvent or its EventContext (None: it names none of them)."""
    target = getattr(exc, "event", None) if isinstance(exc, Permanent | Retryable) else None
    if target is None:
        return None
    for k, event in enumerate(events):
        if target is args[k] or target is event or (contexts and target is contexts[k]):
            return k
    if isinstance(target, InboxEvent):  # a copy of one: the same id (ids are unique here)
        return next((k for k, e in enumerate(events) if e.event_id == target.event_id), None)
    return None


def trace_duplicates(
    run: Sequence[InboxEvent], fresh: Collection[str], unique: dict[str, InboxEvent], consumer: str
) -> None:
    """A duplicate span for each event of ``run`` its claim did not take (``fresh``: the
    new ids; ``unique``: the copy of each id that was claimed)."""
    for event in run:
        if event.event_id not in fresh or unique[event.event_id] is not event:
            tracing.duplicate(event, consumer)

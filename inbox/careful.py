"""The careful path: a savepoint per event, and events handled alone.

When a fast-path transaction fails (``inbox/transaction.py``), it is rolled back and the
run is repeated with a SAVEPOINT per event (:meth:`CarefulPath.savepointed`), so a failing
event does not undo its neighbours; the failing event is then dead-lettered (permanent
error) or, for a retryable one, the events before it are committed and it is retried
*alone* (:meth:`CarefulPath.run_alone`) with a durable attempt count per try and
full-jitter backoff, keeping the partition's order.

After a crash the records of the unfinished run are handled here too, one per transaction
(see ``PartitionProcessor._recover``), so the event that kills the process is isolated
and, after its attempts are used up, dead-lettered without running again.

Database errors are judged by their SQLSTATE (``outbox/dberrors.py``) before a handler's
rules: an outage rolls the transaction back and leaves as ``DatabaseUnavailable`` (the
lane backs off; no event is charged), and a conflict runs the event's attempt again at
once. An attempt the database interrupted left its marker armed, which would read as a
crash once the database is back; the marker remembers it (:class:`inbox.marker.Interrupted`)
and it is taken up again as the same attempt.

Batch handlers: a failed call that cannot be pinned on one event is split in halves, each
under its own savepoint, down to the first failing event (:meth:`CarefulPath.split`); the
events before it commit, and it goes on alone. The calls of the split are not attempts of
the events in them: an event is charged from the run where it failed alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from inbox import failures, tracing
from inbox.app import Handler
from inbox.dead_lettering import DeadLetterer
from inbox.dispatch import Blame, Dispatch, trace_duplicates
from inbox.event import InboxEvent
from inbox.failures import Failure
from inbox.marker import AtCommit, AttemptMarker, Interrupted
from inbox.metrics import Metrics
from inbox.store import InboxStore, Marker
from outbox.db import describe, unavailable
from outbox.dberrors import is_conflict, is_outage
from outbox.resilience.retry import RetryPolicy
from outbox.settings import ConsumerSettings

log = logging.getLogger("outbox.inbox")

# How many times in a row a conflict (serialization failure, deadlock) runs an attempt
# again at once before it counts as a failed attempt like any retryable error.
CONFLICT_RETRIES = 5


@dataclass
class RetryAlone:
    """The run stopped at ``run[index]``, which goes on alone (retried, or dead-lettered)."""

    index: int  # position in the run of the event to retry alone
    failure: Failure
    # Attempts the failure counts: 1, or 0 for a conflict (a serialization failure or a
    # deadlock is the database asking to run the transaction again, not the event's fault).
    prior: int = 1


@dataclass(frozen=True)
class Split:
    """What :meth:`CarefulPath.split` did with a batch handler's group: events
    handled and duplicates, and the first failing event (its index in the group, the
    error) when one failed alone."""

    processed: int
    duplicates: int
    failed: tuple[int, Exception] | None = None


@dataclass
class CarefulPath:
    """One partition's careful transactions (its :class:`PartitionProcessor` decides when)."""

    # The careful paths' sessions (savepoints, retries alone, dead letters).
    sessions: async_sessionmaker[AsyncSession]
    store: InboxStore
    config: ConsumerSettings
    policy: RetryPolicy
    metrics: Metrics
    dispatch: Dispatch
    marker: AttemptMarker
    dead: DeadLetterer
    stopping: asyncio.Event
    # Called after each commit with the last event it finished (see PartitionProcessor).
    progress: Callable[[InboxEvent], Awaitable[None]]

    async def retry_alone(self, run: Sequence[InboxEvent], retry: RetryAlone) -> int:
        """Continue with ``run[retry.index]`` alone; how many of ``run`` are finished."""
        event = run[retry.index]
        # A conflict counted no attempt: the event runs again at once, as its first.
        previous = retry.failure if retry.prior else None
        if not await self.run_alone(event, retry.prior, previous):
            return retry.index
        return retry.index + 1

    async def savepointed(
        self, chunk: Sequence[InboxEvent], at_commit: AtCommit
    ) -> int | RetryAlone:
        processed = duplicates = dead = skipped = 0
        stop: RetryAlone | None = None
        async with self.sessions() as session, session.begin():
            index = 0
            while index < len(chunk):
                event = chunk[index]
                if self.dispatch.needs_policy(event):
                    if await self.dead.apply_policy(session, event):
                        dead += 1
                    else:
                        skipped += 1
                    index += 1
                    continue
                handler = self.dispatch.handler(event)
                assert handler is not None
                if handler.batch:
                    group = self.dispatch.group_at(chunk, index, handler)
                    split = await self.split(session, handler, group)
                    processed += split.processed
                    duplicates += split.duplicates
                    if split.failed is None:
                        index += len(group)
                        continue
                    # The first failing event of the list, found alone; those before it
                    # are handled. It is treated as a per-event handler's failure below.
                    offset, exc = split.failed
                    index += offset
                    event = chunk[index]
                else:
                    savepoint = await session.begin_nested()
                    try:
                        if not await self.store.claim(session, self.dispatch.consumer, [event]):
                            await savepoint.commit()
                            duplicates += 1
                            tracing.duplicate(event, self.dispatch.consumer)
                            index += 1
                            continue
                        await self.dispatch.run_handler(event, session)
                        await savepoint.commit()  # flushes: handler write errors surface here
                        processed += 1
                        index += 1
                        continue
                    except Exception as error:
                        if is_outage(error):
                            # Not the event's fault: the whole transaction rolls back
                            # (leaving this block), and the run is tried again once the
                            # database is back.
                            raise unavailable(error) from error
                        await savepoint.rollback()
                        exc = error
                failure = failures.classify(exc, self.config.error_message_chars)
                if is_conflict(exc):
                    stop = RetryAlone(index, failure, 0)
                    break
                if failure.retryable and self.dispatch.max_attempts(event) > 1:
                    stop = RetryAlone(index, failure)
                    break
                if await self.dead.send(session, event, failure, attempts=1):
                    dead += 1
                index += 1
            if stop is None:
                await self.marker.write_at_commit(session, at_commit)
        if stop is None:
            self.marker.committed(at_commit)
        self._count(processed, duplicates, dead, skipped)
        if stop is not None:
            if stop.index:
                await self.progress(chunk[stop.index - 1])
            return stop
        await self.progress(chunk[-1])
        return len(chunk)

    async def split(
        self, session: AsyncSession, handler: Handler, group: Sequence[InboxEvent]
    ) -> Split:
        """Claim ``group`` and call batch ``handler`` with its new events, under a
        savepoint. If that fails, it is rolled back and the group split in halves, each
        under its own savepoint, down to the first failing event alone: everything before
        that event is handled (its savepoints released), nothing after it is tried, so the
        partition's order holds. A failure the handler pins on one event
        (``Permanent(..., event=item)``) is taken at its word, without a split; a conflict
        (serialization failure, deadlock) is no event's fault and is not split either."""
        unique: dict[str, InboxEvent] = {}
        for event in group:
            unique.setdefault(event.event_id, event)
        blame = Blame()
        new: list[InboxEvent] = []
        savepoint = await session.begin_nested()
        try:
            fresh = await self.store.claim(session, self.dispatch.consumer, list(unique.values()))
            new = [e for e in group if e.event_id in fresh and unique[e.event_id] is e]
            if new:
                await self.dispatch.run_batch(handler, new, session, None, blame)
            await savepoint.commit()  # flushes: the handler's write errors surface here
        except Exception as exc:
            if is_outage(exc):
                raise unavailable(exc) from exc  # the whole transaction rolls back
            await savepoint.rollback()
            if is_conflict(exc):
                # The database asks for the transaction again; no event is at fault. The
                # first one runs again alone (uncharged), the rest in lists after it.
                return Split(0, 0, (0, exc))
            if blame.index is not None:
                culprit = group.index(new[blame.index])
                before = (
                    await self.split(session, handler, group[:culprit]) if culprit else Split(0, 0)
                )
                if before.failed is not None:
                    return before
                return replace(before, failed=(culprit, exc))
            if len(group) == 1:
                return Split(0, 0, (0, exc))
            half = len(group) // 2
            left = await self.split(session, handler, group[:half])
            if left.failed is not None:
                return left
            right = await self.split(session, handler, group[half:])
            failed = None if right.failed is None else (half + right.failed[0], right.failed[1])
            return Split(
                left.processed + right.processed, left.duplicates + right.duplicates, failed
            )
        if len(new) < len(group):
            trace_duplicates(group, fresh, unique, self.dispatch.consumer)
        return Split(len(new), len(group) - len(new))

    def _count(self, processed: int, duplicates: int, dead: int, skipped: int) -> None:
        """The outcome of one committed careful-path transaction."""
        self.metrics.transactions()
        self.metrics.processed(processed)
        self.metrics.duplicates(duplicates)
        self.metrics.dead_lettered(dead)
        self.metrics.skipped(skipped)

    # ------------------------------------------------------------- careful path

    async def run_alone(
        self,
        event: InboxEvent,
        prior: int,
        previous: Failure | str | None,
        *,
        charge: int = 0,
        resume: bool = False,
    ) -> bool:
        """Handle one event in its own transactions, counting each attempt durably before
        it runs. ``prior`` attempts were already made, the last one failing with
        ``previous`` (a Failure seen in this process, or the text recorded in the marker).
        ``charge`` extra attempts are recorded durably with the first attempt only: they
        count if this attempt kills the process. ``resume``: the next attempt was begun
        already and interrupted by the database (run it at once, as the same attempt).
        False if stopped before finishing.

        Database errors are judged by their SQLSTATE (``outbox/dberrors.py``) before the
        handler's rules: an outage leaves (the lane backs off, the attempt is taken up
        again afterwards, see :class:`Interrupted`); a conflict runs the same attempt
        again at once, up to ``CONFLICT_RETRIES`` times in a row."""
        if self.dispatch.needs_policy(event):
            async with self.sessions() as session, session.begin():
                dead = await self.dead.apply_policy(session, event)
                await self.marker.finish(session)
            self.marker.finished()
            self._count(0, 0, int(dead), int(not dead))
            await self.progress(event)
            return True
        limit = self.dispatch.max_attempts(event)
        attempts = prior
        last_error = previous.text() if isinstance(previous, Failure) else previous
        # The failed attempts this process saw, for the dead letter's history.
        seen = [previous] if isinstance(previous, Failure) else []
        if isinstance(previous, Failure) and (not previous.retryable or prior >= limit):
            await self.dead_letter(event, previous, prior, seen)
            return True
        at_once = resume
        conflicts = 0
        while True:
            if attempts >= limit:
                failure = failures.crashed(attempts, last_error, self.config.error_message_chars)
                await self.dead_letter(event, failure, attempts, [*seen, failure])
                return True
            if attempts > 0 and not at_once:
                self.metrics.retries()
                if await self._sleep(self.policy.backoff(attempts - 1)):
                    return False
            at_once = False
            attempt = attempts + 1
            marker = Marker(event.offset, event.offset, attempt + charge, last_error)
            # Before the write: its outcome is unknown if the database goes meanwhile.
            self.marker.interrupted = Interrupted(marker, attempts, last_error, charge)
            await self.marker.mark(marker)
            try:
                async with self.sessions() as session, session.begin():
                    fresh = await self.store.claim(
                        session, self.dispatch.consumer, [event], attempts=attempt
                    )
                    if fresh:
                        await self.dispatch.run_handler(event, session, attempt)
                    else:
                        tracing.duplicate(event, self.dispatch.consumer)
                    await self.marker.finish(session)
                self.marker.finished()
            except Exception as exc:
                if is_outage(exc):
                    # Rolled back; not this event's fault. The lane backs off and, once the
                    # database is back, the marker read again is this one: same attempt.
                    raise unavailable(exc) from exc
                if is_conflict(exc) and conflicts < CONFLICT_RETRIES:
                    conflicts += 1
                    at_once = True
                    log.info(
                        "handler transaction conflicted; running it again",
                        extra={
                            "consumer": self.dispatch.consumer,
                            "event_id": event.event_id,
                            "attempt": attempt,
                            "error": _database_cause(exc),
                        },
                    )
                    continue  # the same attempt: neither attempts nor charge move
                self.marker.interrupted = None
                attempts, charge = attempt, 0
                failure = failures.classify(exc, self.config.error_message_chars)
                seen.append(failure)
                log.info(
                    "handler failed",
                    extra={
                        "consumer": self.dispatch.consumer,
                        "event_id": event.event_id,
                        "topic": event.topic,
                        "partition": event.partition,
                        "attempt": attempts,
                        "error": failure.error_class,
                        "error_message": failure.message,
                        "retryable": failure.retryable,
                    },
                )
                if not failure.retryable or attempts >= limit:
                    # Should the database go while the dead letter is written, it is
                    # written after the outage with this failure (not as a crash).
                    self.marker.interrupted = Interrupted(marker, attempts, last_error, 0, failure)
                    await self.dead_letter(event, failure, attempts, seen)
                    return True
                last_error = failure.text()
                await self.marker.mark(Marker(event.offset, event.offset, attempts, last_error))
                continue
            self._count(int(bool(fresh)), int(not fresh), 0, 0)
            await self.progress(event)
            return True

    async def _sleep(self, seconds: float) -> bool:
        """Back off; True if asked to stop meanwhile."""
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    async def dead_letter(
        self,
        event: InboxEvent,
        failure: Failure,
        attempts: int,
        history: Sequence[Failure] = (),
    ) -> None:
        async with self.sessions() as session, session.begin():
            dead = await self.dead.send(session, event, failure, attempts, history)
            await self.marker.finish(session)
        self.marker.finished()
        self._count(0, int(not dead), int(dead), 0)
        await self.progress(event)


def _database_cause(exc: BaseException) -> str:
    """SQLSTATE and primary message of a database error (never the statement or its
    parameters, which SQLAlchemy's own text carries)."""
    sqlstate, message, _ = describe(exc)
    return f"{message} [SQLSTATE {sqlstate}]" if sqlstate else message

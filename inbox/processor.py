"""Handling the records of one partition, in offset order, effectively once.

A *run* is a contiguous slice of a partition's records handled in one transaction (up to
``max_batch_records`` of them, or one in ``transaction_per="event"`` mode). Before any of
its handlers starts, the partition's durable attempt marker must say "run [first, last]
started" (attempts > 0), committed; the run's own commit moves the marker on. So a marker
still armed when the same offsets come back means the run never finished — the process
died inside a handler, or was killed. That is how attempts are counted durably without one
extra commit per event.

Keeping that marker costs almost nothing on the hot path:

* It is read once per partition assignment and then cached: while this process owns the
  partition, only this process writes it, and every write goes through this class, which
  updates the cache after the write committed (and forgets the cache when an error leaves
  the database state unknown).
* A run's commit arms the marker for the *next* run (same transaction, no extra commit):
  exactly for the next run when it is already in hand, else for the next ``AHEAD``
  offsets, whatever run starts there. So neither back-to-back runs nor the short runs of
  a slow stream write the marker on their own; only a run the marker does not cover (one
  longer than ``AHEAD`` after a pause, or the first after careful mode) commits it alone
  first, in one autocommit statement. The window between "marker says started" and the
  first handler is then the same as with a write right before the run: a few lines of
  Python, never a wait. A marker armed ahead is disarmed before the processor lets go of
  the partition (stop, rebalance), so the next owner does not mistake it for a crash.

  The price of arming ahead: a process that dies — killed, or killed by a handler of
  *another* partition — leaves every partition it owns armed, for up to ``AHEAD``
  offsets that may never have run, unless the partition had been quiet for
  ``disarm_idle_seconds`` (its lane then disarms the marker, off the hot path). The
  next owner handles those records in careful mode (one per transaction), and should one
  of them kill the process on its first attempt there, that crash is charged the phantom
  run as well: such a record runs max_attempts - 1 times instead of max_attempts. A
  record whose own run killed the process is counted exactly (max_attempts runs).

Fast path: one transaction per run, on a connection kept open between transactions: all
inbox rows claimed in one statement (which also opens the transaction, BEGIN riding in its
round trip), handlers run one after another in a session bound to that connection, one
commit (:func:`_transaction`). If anything raises, the transaction is rolled back and the
run is repeated with a SAVEPOINT per event, so a failing event does not undo its
neighbours; the failing event is then dead-lettered (permanent error) or, for a retryable
one, the events before it are committed and it is retried *alone* ("careful" mode) with a
durable attempt count per try and full-jitter backoff, keeping the partition's order.

After a crash the records of the unfinished run are handled in careful mode, one per
transaction, so the event that kills the process is isolated and, after its attempts are
used up, dead-lettered without running again.

Database errors are judged by their SQLSTATE (``outbox/dberrors.py``) before a handler's
rules, wherever they were raised (the claim, a handler's own INSERT, the commit): an
outage rolls the transaction back and leaves :meth:`process` as ``DatabaseUnavailable`` (the
lane backs off; no event is charged), and a conflict runs the event's attempt again at once.
An attempt the database interrupted in careful mode left its marker armed, which would read
as a crash once the database is back; the processor remembers it (:class:`_Interrupted`)
and takes it up again as the same attempt. Fast-path runs need nothing more: a marker this
process armed with one attempt and no error is already known as its own (``_mine``).

Shared transaction (:func:`process_together`): when several partitions each have a small
run ready at once, the per-transaction cost (claim, flush, commit; about all the CPU at a
few events per run) is paid once for all of them. Each partition's marker must cover its
run first (armed ahead by its previous commit, else armed now: one autocommit statement
for all that need it), then one transaction claims every run, handles each partition's
records in offset order and arms every marker ahead; offsets move only after that
commit. A crash inside it leaves each partition's marker armed, exactly as concurrent
per-partition runs would. If it fails, it is rolled back and every partition
runs alone again (its marker is still armed for it, so that costs no marker write); the
partition whose handler raised resumes from that failure as after a failed run of its own
(first attempt counted), in its own lane so its retries block no other partition. A
failure no handler raised (a write refused at the final flush, the commit) cannot be
pinned on a partition: each runs its next run alone, where the savepoint per event finds
it (sharing again would fail again, forever).

Batch handlers (``@app.handler(..., batch=True)``): a transaction calls one with each run
of consecutive new events it takes (:func:`_groups`: across the members, in offset order
per partition, up to its ``max_batch``). A failed call cannot be pinned on one event unless
the failure says which (an unreadable sequence or a payload that failed for one event, a
``Permanent``/``Retryable`` raised with ``event=``, a list of one): then that event is
the failing handler above, first attempt counted. Otherwise the failure is like one at the
final flush: the partition runs again with a savepoint per call (:meth:`_savepointed`),
where a failing call is split in halves, each under its own savepoint, down to the first
failing event (:meth:`_split`); the events before it commit, and it goes on alone. The
calls of the split are not attempts of the events in them: an event is charged from the
run where it failed alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace

from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from inbox import failures, tracing
from inbox.app import Consumer, Handler
from inbox.connections import Connections, Held
from inbox.context import EventContext
from inbox.dead_lettering import DeadLetterer, DeadLetterSink
from inbox.event import InboxEvent
from inbox.failures import Failure
from inbox.metrics import Metrics
from inbox.store import Arm, Driver, InboxStore, Marker
from outbox.db import describe, unavailable
from outbox.dberrors import is_conflict, is_outage
from outbox.resilience.classify import Permanent, Retryable
from outbox.resilience.retry import RetryPolicy
from outbox.settings import ConsumerSettings

log = logging.getLogger("outbox.inbox")

# How many offsets past a finished run its commit arms the marker for (see the docstring).
AHEAD = 32
# How many times in a row a conflict (serialization failure, deadlock) runs an attempt
# again at once before it counts as a failed attempt like any retryable error.
CONFLICT_RETRIES = 5

# (after_offset, limit) -> up to ``limit`` queued records with a higher offset, in order.
Queued = Callable[[int, int], Sequence[InboxEvent]]


class _Keep(enum.Enum):
    """Leave the attempt marker as it is (records known to be finished already)."""

    KEEP = 0


KEEP = _Keep.KEEP
# What a run's commit does to the marker: arm it (for the next run, or ahead), or KEEP it.
AtCommit = Marker | _Keep


class _Unread(enum.Enum):
    UNREAD = 0


UNREAD = _Unread.UNREAD


class _Stop(Exception):
    """The fast transaction failed and was rolled back (internal control flow).

    ``at`` is the member (its position in the transaction's members) and the event in its
    run whose handler raised, or None when the failure cannot be pinned on one event (the
    claim, or the final flush of the handlers' writes, or the commit).
    """

    def __init__(self, at: tuple[int, int] | None, cause: Exception) -> None:
        super().__init__(at)
        self.at = at
        self.cause = cause


@dataclass
class _RetryAlone:
    index: int  # position in the run of the event to retry alone
    failure: Failure
    # Attempts the failure counts: 1, or 0 for a conflict (a serialization failure or a
    # deadlock is the database asking to run the transaction again, not the event's fault).
    prior: int = 1


@dataclass(frozen=True)
class _Split:
    """What :meth:`PartitionProcessor._split` did with a batch handler's group: events
    handled and duplicates, and the first failing event (its index in the group, the
    error) when one failed alone."""

    processed: int
    duplicates: int
    failed: tuple[int, Exception] | None = None


@dataclass(frozen=True)
class _Interrupted:
    """A careful attempt (or its dead letter) that the database interrupted, in this process.

    ``marker`` is the durable marker the attempt wrote (or may have written: the write's
    outcome is unknown when the outage hit it). A marker left armed is normally taken for a
    crash of the handler under it; but this process is alive and saw the database go, so
    when the marker read back after the outage is still exactly this one, the run it guards
    did not crash: the next run is the *same* attempt (``prior`` attempts done before it,
    ``last_error``, the crash ``charge`` it carried), or, when ``failure`` is set, the
    attempt had failed and only its dead letter was left to write. Kept in memory only: a
    process that dies during the outage leaves the marker to count as a crash, which at
    worst charges one attempt for an outage followed by a crash (the safe direction).
    """

    marker: Marker
    prior: int
    last_error: str | None
    charge: int
    failure: Failure | None = None


@dataclass
class PartitionProcessor:
    app: Consumer
    config: ConsumerSettings
    store: InboxStore
    # The careful paths' sessions (savepoints, retries alone, dead letters).
    sessions: async_sessionmaker[AsyncSession]
    # Connections kept open in autocommit mode: one statement = one durable commit, one
    # round trip (the marker writes that must commit before handlers run). The fast runs'
    # and shared transactions are opened on them by their claim (see _transaction).
    connections: Connections
    sink: DeadLetterSink
    policy: RetryPolicy
    metrics: Metrics
    topic: str
    partition: int
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # Called after each database commit with the next offset to consume.
    on_progress: Callable[[int], Awaitable[None]] | None = None
    # The durable marker as last read or committed by this process (see module docstring).
    _marker: Marker | _Unread | None = field(default=UNREAD, init=False)
    # (first, last) when the durable marker is armed (attempts 1) for a run this process
    # has not started yet, or started without it killing the process: such a marker is
    # ours, not evidence of a crash.
    _ready: tuple[int, int] | None = field(default=None, init=False)
    # Spans this process armed (one attempt, no error) whose write may have reached the
    # database. When an error leaves the durable state unknown, a marker re-read with one
    # of these spans is ours: a process that is still alive did not crash under it.
    _mine: set[tuple[int, int]] = field(default_factory=set, init=False)
    # (offset, error) of the handler that failed in a shared transaction, to resume from.
    _failed: tuple[int, Exception] | None = field(default=None, init=False)
    # A shared transaction failed where no handler raised (the final flush, the commit):
    # run alone next, where a savepoint per event finds the culprit, instead of sharing
    # (and failing) again.
    _solo: bool = field(default=False, init=False)
    # The careful attempt the database interrupted (see _Interrupted); outlives _forget().
    _interrupted: _Interrupted | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._dead = DeadLetterer(self.app.name, self.config, self.store, self.sink, self.metrics)
        # This partition's routing table (type -> handler), resolved once.
        self._route = self.app.router(self.topic)

    @property
    def consumer(self) -> str:
        return self.app.name

    # ------------------------------------------------------------------ driver

    async def process(self, queued: Queued) -> int:
        """Handle queued records in runs until none is left (or ``4 * max_batch_records``
        were finished, to let other partitions have the slot); return how many finished.

        Stops early (between runs, or during a retry's backoff) when ``stopping`` is set;
        the caller re-reads the rest from Kafka.
        """
        size = 1 if self.config.transaction_per == "event" else self.config.max_batch_records
        budget = 4 * self.config.max_batch_records
        self._solo = False
        try:
            if self._marker is UNREAD:
                self._marker = marker = await self._read_marker()
                self._ready = None
                if (
                    marker is not None
                    and marker.attempts == 1
                    and marker.last_error is None
                    and _span_of(marker) in self._mine
                ):
                    self._ready = _span_of(marker)
                self._mine = {self._ready} if self._ready else set()
            done = 0
            run = queued(-1, size)
            if self._failed is not None and run:
                offset, cause = self._failed
                self._failed = None
                done = await self._resume(run, offset, cause)
                run = queued(run[done - 1].offset, size) if done else ()
            while run and done < budget and not self.stopping.is_set():
                following: Sequence[InboxEvent] = ()
                if done + len(run) < budget:
                    following = queued(run[-1].offset, size)
                n = await self._step(run, following)
                if n == 0:
                    break
                done += n
                if n == len(run) and following and self._ready == _span(following):
                    run = following  # exactly the run the marker was armed for
                else:
                    run = queued(run[n - 1].offset, size)
            return done
        except BaseException:
            # A failed or cancelled commit leaves the marker's durable state unknown.
            self._forget()
            raise

    def _forget(self) -> None:
        self._marker, self._ready, self._failed = UNREAD, None, None

    async def release(self) -> None:
        """Disarm a marker armed ahead: before letting go of the partition (or the next
        owner would take it for a crash), or when the partition has gone quiet."""
        if not self._mine:
            return
        try:
            async with self._connection() as raw:
                for span in self._mine:  # one, or two when an error hid which one is durable
                    await self.store.disarm_marker(
                        raw, self.consumer, self.topic, self.partition, span
                    )
            self._finished()
        except BaseException:
            self._forget()
            raise

    @property
    def armed_ahead(self) -> bool:
        """Whether a marker this process armed may still be set (see :meth:`release`)."""
        return bool(self._mine)

    def ready_run(self, queued: Queued) -> Sequence[InboxEvent] | None:
        """Everything queued, if it can join a shared transaction: a short run (all the
        partition has) on the fast path, its marker unarmed or armed by this process for
        it, nothing to recover or resume."""
        if (
            self.config.transaction_per != "batch"
            or self.stopping.is_set()
            or isinstance(self._marker, _Unread)
            or self._failed is not None
            or self._solo
        ):
            return None
        run = queued(-1, self.config.max_batch_records)
        if not run or queued(run[-1].offset, 1) or any(self._needs_policy(e) for e in run):
            return None
        span = self._ready if _covers(self._ready, run) else None
        if span is None and self._marker is not None and self._marker.attempts > 0:
            return None  # armed by a crashed owner (recovery) or for another run
        first, last = span or _span(run)
        if first == last and self._max_attempts(run[0]) < 2:
            # A neighbour that kills the process charges this run's marker an attempt;
            # a one-record marker counts it against that record (a batch marker does not),
            # and with one attempt allowed it would be dead-lettered without running.
            return None
        return run

    async def _resume(self, run: Sequence[InboxEvent], offset: int, cause: Exception) -> int:
        """Continue after the handler at ``offset`` failed in a shared transaction, as
        after a failed fast run of our own (the marker is still armed for it)."""
        index = next((i for i, e in enumerate(run) if e.offset == offset), None)
        if index is None:  # cannot happen: the lane keeps every unfinished record
            return 0
        result = await self._failed_at(run, index, cause)
        if isinstance(result, _RetryAlone):
            return await self._retry_alone(run, result)
        return result

    async def _retry_alone(self, run: Sequence[InboxEvent], retry: _RetryAlone) -> int:
        """Continue with ``run[retry.index]`` alone; how many of ``run`` are finished."""
        event = run[retry.index]
        # A conflict counted no attempt: the event runs again at once, as its first.
        previous = retry.failure if retry.prior else None
        if not await self._alone(event, retry.prior, previous):
            return retry.index
        return retry.index + 1

    async def _step(self, run: Sequence[InboxEvent], following: Sequence[InboxEvent]) -> int:
        if self._ready is not None:
            # The marker is ours: skip writing it if it already covers exactly this run.
            return await self._batch(run, following, marked=_covers(self._ready, run))
        prev = self._marker
        assert not isinstance(prev, _Unread)
        if prev is not None and prev.attempts > 0:
            first = run[0].offset
            if first < prev.start_offset:
                # Records before the unfinished run were finished before it started (they
                # are inbox duplicates now); the marker is left for the run itself.
                ahead = [e for e in run if e.offset < prev.start_offset]
                return await self._batch(ahead, (), marked=True, keep=True)
            if first == prev.start_offset:
                # The run over these offsets never finished: it may have killed the
                # process. Handle its records one at a time.
                return await self._recover(run, prev)
        return await self._batch(run, following, marked=False)

    async def _recover(self, run: Sequence[InboxEvent], prev: Marker) -> int:
        crashed = [e for e in run if e.offset <= prev.end_offset]
        if prev.start_offset == prev.end_offset:
            cut = self._interrupted
            if cut is not None and cut.marker == prev:
                # Not a crash: the database interrupted this process's own attempt (see
                # _Interrupted). Take it up again as the same attempt.
                if cut.failure is not None:
                    await self._dead_letter_alone(crashed[0], cut.failure, cut.prior)
                    return 1
                again = await self._alone(
                    crashed[0], cut.prior, cut.last_error, charge=cut.charge, resume=True
                )
                return int(again)
            # A single-record marker counts that record's attempts exactly.
            return int(await self._alone(crashed[0], prev.attempts, prev.last_error))
        # A batch marker says only that the batch died somewhere in it. Each of its
        # records runs alone; the one that dies again is charged the batch run as well,
        # so a process-killing handler runs exactly max_attempts times (for N >= 2).
        done = 0
        for event in crashed:
            if not await self._alone(event, 0, None, charge=1):
                break
            done += 1
        return done

    # ------------------------------------------------------------ the marker

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Driver]:
        """A held connection for autocommit statements (each commits on its own)."""
        held = await self.connections.take()
        try:
            yield held.raw
        finally:
            await self.connections.give(held)

    async def _read_marker(self) -> Marker | None:
        async with self._connection() as raw:
            return await self.store.marker(raw, self.consumer, self.topic, self.partition)

    async def _mark(self, marker: Marker, *, ready: bool = False) -> None:
        """Commit ``marker`` on its own, before the handlers it guards run. ``ready``: it
        is armed for a fast-path run (else it counts a careful attempt)."""
        if ready:
            self._mine.add(_span_of(marker))
        async with self._connection() as raw:
            await self.store.set_marker(raw, self.consumer, self.topic, self.partition, marker)
        if ready:
            self._committed(marker)
        else:
            self._marker, self._ready, self._mine = marker, None, set()

    async def _write_at_commit(self, session: AsyncSession, at_commit: AtCommit) -> None:
        """Add the marker change ``at_commit`` to the run's transaction."""
        if not isinstance(at_commit, _Keep):
            await self.store.set_marker(
                session, self.consumer, self.topic, self.partition, at_commit
            )

    def _committed(self, at_commit: AtCommit) -> None:
        """Mirror a committed ``at_commit`` in the cache."""
        if not isinstance(at_commit, _Keep):
            self._marker = at_commit
            self._ready = _span_of(at_commit)
            self._mine = {self._ready}
            self._interrupted = None

    def _finished(self) -> None:
        if isinstance(self._marker, Marker):
            self._marker = replace(self._marker, attempts=0, last_error=None)
        self._ready, self._mine, self._interrupted = None, set(), None

    # -------------------------------------------------------------- batch paths

    async def _progress(self, event: InboxEvent) -> None:
        if self.on_progress is not None:
            await self.on_progress(event.offset + 1)

    async def _batch(
        self,
        run: Sequence[InboxEvent],
        following: Sequence[InboxEvent],
        *,
        marked: bool,
        keep: bool = False,
    ) -> int:
        """Handle a run in one transaction; return how many records were finished.

        ``marked``: the durable marker already covers this run (else it is committed
        first). The run's commit arms the marker for ``following`` (the next run), or
        ahead of the run when there is none — or leaves it alone (``keep``).
        """
        if not marked:
            await self._mark(Marker(run[0].offset, run[-1].offset, 1, None), ready=True)
        at_commit: AtCommit = _ahead(run)
        if keep:
            at_commit = KEEP
        elif following:
            at_commit = Marker(following[0].offset, following[-1].offset, 1, None)
        result = await self._chunk(run, at_commit)
        if isinstance(result, _RetryAlone):
            return await self._retry_alone(run, result)
        return result

    async def _chunk(self, chunk: Sequence[InboxEvent], at_commit: AtCommit) -> int | _RetryAlone:
        if not isinstance(at_commit, _Keep):
            self._mine.add(_span_of(at_commit))
        if not any(self._needs_policy(e) for e in chunk):
            try:
                return await self._fast(chunk, at_commit)
            except _Stop as stop:
                if stop.at is not None:
                    return await self._failed_at(chunk, stop.at[1], stop.cause)
        return await self._savepointed(chunk, at_commit)

    async def _failed_at(
        self, chunk: Sequence[InboxEvent], index: int, cause: Exception
    ) -> int | _RetryAlone:
        """The fast run failed in the handler of ``chunk[index]``: that was the event's
        first attempt. Commit the events before it; it continues alone (retried, or
        dead-lettered)."""
        failure = failures.classify(cause, self.config.error_message_chars)
        if index:
            done = await self._prefix(chunk[:index])
            if done < index:
                return done
        return _RetryAlone(index, failure, 0 if is_conflict(cause) else 1)

    async def _prefix(self, chunk: Sequence[InboxEvent]) -> int:
        result = await self._chunk(chunk, KEEP)
        if isinstance(result, _RetryAlone):
            # Cannot happen with deterministic handlers; treat as a fresh failure there.
            return await self._retry_alone(chunk, result)
        return result

    def _handler(self, event: InboxEvent) -> Handler | None:
        return self._route(event.event_type)

    def _needs_policy(self, event: InboxEvent) -> bool:
        return event.malformed is not None or self._handler(event) is None

    def _max_attempts(self, event: InboxEvent) -> int:
        handler = self._handler(event)
        if handler is not None and handler.max_attempts is not None:
            return handler.max_attempts
        return self.config.max_attempts

    async def _run_handler(
        self,
        event: InboxEvent,
        session: AsyncSession,
        attempt: int = 1,
        raw: Driver | None = None,
    ) -> None:
        """Run the event's handler in ``session``'s transaction (``raw``: the psycopg
        connection under it, when the caller has it at hand)."""
        handler = self._handler(event)
        assert handler is not None
        if handler.stale is not None and await self._stale(event, raw or session):
            return
        started = time.perf_counter()
        try:
            with tracing.process(event, self.consumer, attempt):
                await handler(event, session, attempt)
        finally:
            self.metrics.handler_seconds(time.perf_counter() - started)
        if handler.batch:
            self.metrics.batch_size(1)

    async def _run_batch(
        self,
        handler: Handler,
        events: Sequence[InboxEvent],
        session: AsyncSession,
        raw: Driver | None,
        blame: _Blame,
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
            # A list of one is that event's failure, named or not.
            pinned = 0 if len(kept) == 1 else _pinned(exc, kept, args, contexts)
            if pinned is not None:
                blame.index = events.index(kept[pinned])
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

    async def _fast(self, chunk: Sequence[InboxEvent], at_commit: AtCommit) -> int:
        """One transaction, no savepoints. Raises _Stop if anything failed (rolled back)."""
        arm = [] if isinstance(at_commit, _Keep) else [self._arm(at_commit)]
        fresh, unique = await _transaction(self.connections, [(self, chunk)], arm)
        self._committed(at_commit)
        self._count_claimed(chunk, fresh, unique)
        await self._progress(chunk[-1])
        return len(chunk)

    def _arm(self, marker: Marker) -> Arm:
        """``marker`` (armed: one attempt, no error) for a claim's ``arm``."""
        assert marker.attempts == 1 and marker.last_error is None
        return self.topic, self.partition, marker.start_offset, marker.end_offset

    def _count_claimed(
        self, run: Sequence[InboxEvent], fresh: Collection[str], unique: dict[str, InboxEvent]
    ) -> None:
        new = sum(1 for e in run if e.event_id in fresh and unique[e.event_id] is e)
        self.metrics.processed(new)
        self.metrics.duplicates(len(run) - new)
        if new < len(run):
            _trace_duplicates(run, fresh, unique, self.consumer)

    async def _savepointed(
        self, chunk: Sequence[InboxEvent], at_commit: AtCommit
    ) -> int | _RetryAlone:
        processed = duplicates = dead = skipped = 0
        stop: _RetryAlone | None = None
        async with self.sessions() as session, session.begin():
            index = 0
            while index < len(chunk):
                event = chunk[index]
                if self._needs_policy(event):
                    if await self._dead.apply_policy(session, event):
                        dead += 1
                    else:
                        skipped += 1
                    index += 1
                    continue
                handler = self._handler(event)
                assert handler is not None
                if handler.batch:
                    group = self._group_at(chunk, index, handler)
                    split = await self._split(session, handler, group)
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
                        if not await self.store.claim(session, self.consumer, [event]):
                            await savepoint.commit()
                            duplicates += 1
                            tracing.duplicate(event, self.consumer)
                            index += 1
                            continue
                        await self._run_handler(event, session)
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
                    stop = _RetryAlone(index, failure, 0)
                    break
                if failure.retryable and self._max_attempts(event) > 1:
                    stop = _RetryAlone(index, failure)
                    break
                if await self._dead.send(session, event, failure, attempts=1):
                    dead += 1
                index += 1
            if stop is None:
                await self._write_at_commit(session, at_commit)
        if stop is None:
            self._committed(at_commit)
        self._count(processed, duplicates, dead, skipped)
        if stop is not None:
            if stop.index:
                await self._progress(chunk[stop.index - 1])
            return stop
        await self._progress(chunk[-1])
        return len(chunk)

    def _group_at(
        self, chunk: Sequence[InboxEvent], index: int, handler: Handler
    ) -> Sequence[InboxEvent]:
        """The events of one call of batch ``handler`` starting at ``chunk[index]``."""
        end = index + 1
        limit = index + handler.batch_limit(self.config.handler_max_batch)
        while (
            end < min(len(chunk), limit)
            and not self._needs_policy(chunk[end])
            and self._handler(chunk[end]) is handler
        ):
            end += 1
        return chunk[index:end]

    async def _split(
        self, session: AsyncSession, handler: Handler, group: Sequence[InboxEvent]
    ) -> _Split:
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
        blame = _Blame()
        new: list[InboxEvent] = []
        savepoint = await session.begin_nested()
        try:
            fresh = await self.store.claim(session, self.consumer, list(unique.values()))
            new = [e for e in group if e.event_id in fresh and unique[e.event_id] is e]
            if new:
                await self._run_batch(handler, new, session, None, blame)
            await savepoint.commit()  # flushes: the handler's write errors surface here
        except Exception as exc:
            if is_outage(exc):
                raise unavailable(exc) from exc  # the whole transaction rolls back
            await savepoint.rollback()
            if is_conflict(exc):
                # The database asks for the transaction again; no event is at fault. The
                # first one runs again alone (uncharged), the rest in lists after it.
                return _Split(0, 0, (0, exc))
            if blame.index is not None:
                culprit = group.index(new[blame.index])
                before = (
                    await self._split(session, handler, group[:culprit])
                    if culprit
                    else _Split(0, 0)
                )
                if before.failed is not None:
                    return before
                return replace(before, failed=(culprit, exc))
            if len(group) == 1:
                return _Split(0, 0, (0, exc))
            half = len(group) // 2
            left = await self._split(session, handler, group[:half])
            if left.failed is not None:
                return left
            right = await self._split(session, handler, group[half:])
            failed = None if right.failed is None else (half + right.failed[0], right.failed[1])
            return _Split(
                left.processed + right.processed, left.duplicates + right.duplicates, failed
            )
        if len(new) < len(group):
            _trace_duplicates(group, fresh, unique, self.consumer)
        return _Split(len(new), len(group) - len(new))

    def _count(self, processed: int, duplicates: int, dead: int, skipped: int) -> None:
        """The outcome of one committed careful-path transaction."""
        self.metrics.transactions()
        self.metrics.processed(processed)
        self.metrics.duplicates(duplicates)
        self.metrics.dead_lettered(dead)
        self.metrics.skipped(skipped)

    # ------------------------------------------------------------- careful path

    async def _alone(
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
        again afterwards, see :class:`_Interrupted`); a conflict runs the same attempt
        again at once, up to ``CONFLICT_RETRIES`` times in a row."""
        if self._needs_policy(event):
            async with self.sessions() as session, session.begin():
                dead = await self._dead.apply_policy(session, event)
                await self.store.finish_marker(session, self.consumer, self.topic, self.partition)
            self._finished()
            self._count(0, 0, int(dead), int(not dead))
            await self._progress(event)
            return True
        limit = self._max_attempts(event)
        attempts = prior
        last_error = previous.text() if isinstance(previous, Failure) else previous
        if isinstance(previous, Failure) and (not previous.retryable or prior >= limit):
            await self._dead_letter_alone(event, previous, prior)
            return True
        at_once = resume
        conflicts = 0
        while True:
            if attempts >= limit:
                failure = failures.crashed(attempts, last_error, self.config.error_message_chars)
                await self._dead_letter_alone(event, failure, attempts)
                return True
            if attempts > 0 and not at_once:
                self.metrics.retries()
                if await self._sleep(self.policy.backoff(attempts - 1)):
                    return False
            at_once = False
            attempt = attempts + 1
            marker = Marker(event.offset, event.offset, attempt + charge, last_error)
            # Before the write: its outcome is unknown if the database goes meanwhile.
            self._interrupted = _Interrupted(marker, attempts, last_error, charge)
            await self._mark(marker)
            try:
                async with self.sessions() as session, session.begin():
                    fresh = await self.store.claim(
                        session, self.consumer, [event], attempts=attempt
                    )
                    if fresh:
                        await self._run_handler(event, session, attempt)
                    else:
                        tracing.duplicate(event, self.consumer)
                    await self.store.finish_marker(
                        session, self.consumer, self.topic, self.partition
                    )
                self._finished()
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
                            "consumer": self.consumer,
                            "event_id": event.event_id,
                            "attempt": attempt,
                            "error": _database_cause(exc),
                        },
                    )
                    continue  # the same attempt: neither attempts nor charge move
                self._interrupted = None
                attempts, charge = attempt, 0
                failure = failures.classify(exc, self.config.error_message_chars)
                log.info(
                    "handler failed",
                    extra={
                        "consumer": self.consumer,
                        "event_id": event.event_id,
                        "topic": event.topic,
                        "partition": event.partition,
                        "attempt": attempts,
                        "error": failure.error_class,
                        "retryable": failure.retryable,
                    },
                )
                if not failure.retryable or attempts >= limit:
                    # Should the database go while the dead letter is written, it is
                    # written after the outage with this failure (not as a crash).
                    self._interrupted = _Interrupted(marker, attempts, last_error, 0, failure)
                    await self._dead_letter_alone(event, failure, attempts)
                    return True
                last_error = failure.text()
                await self._mark(Marker(event.offset, event.offset, attempts, last_error))
                continue
            self._count(int(bool(fresh)), int(not fresh), 0, 0)
            await self._progress(event)
            return True

    async def _sleep(self, seconds: float) -> bool:
        """Back off; True if asked to stop meanwhile."""
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    async def _dead_letter_alone(self, event: InboxEvent, failure: Failure, attempts: int) -> None:
        async with self.sessions() as session, session.begin():
            dead = await self._dead.send(session, event, failure, attempts)
            await self.store.finish_marker(session, self.consumer, self.topic, self.partition)
        self._finished()
        self._count(0, int(not dead), int(dead), 0)
        await self._progress(event)


def _database_cause(exc: BaseException) -> str:
    """SQLSTATE and primary message of a database error (never the statement or its
    parameters, which SQLAlchemy's own text carries)."""
    sqlstate, message, _ = describe(exc)
    return f"{message} [SQLSTATE {sqlstate}]" if sqlstate else message


def _trace_duplicates(
    run: Sequence[InboxEvent], fresh: Collection[str], unique: dict[str, InboxEvent], consumer: str
) -> None:
    for event in run:
        if event.event_id not in fresh or unique[event.event_id] is not event:
            tracing.duplicate(event, consumer)


def _span(run: Sequence[InboxEvent]) -> tuple[int, int]:
    return run[0].offset, run[-1].offset


def _span_of(marker: Marker) -> tuple[int, int]:
    return marker.start_offset, marker.end_offset


def _covers(span: tuple[int, int] | None, run: Sequence[InboxEvent]) -> bool:
    """Whether a marker armed for ``span`` covers ``run`` (it must start where the run
    does: records before its start are not guarded by it)."""
    return span is not None and span[0] == run[0].offset and run[-1].offset <= span[1]


def _ahead(run: Sequence[InboxEvent]) -> Marker:
    """The marker a run's commit leaves when the next run is not in hand yet."""
    after = run[-1].offset + 1
    return Marker(after, after + AHEAD - 1, 1, None)


async def process_together(
    members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]],
) -> None:
    """Handle several partitions' runs (from :meth:`PartitionProcessor.ready_run`) in one
    transaction (see the module docstring). Whatever is not finished when this returns is
    left to each partition's own :meth:`PartitionProcessor.process`."""
    lead = members[0][0]
    try:
        # Most members' markers are armed ahead by their previous commit already.
        unarmed = [(p, run) for p, run in members if not _covers(p._ready, run)]
        for p, run in unarmed:
            p._mine.add(_span(run))
        if unarmed:
            runs = [(p.topic, p.partition, run[0].offset, run[-1].offset) for p, run in unarmed]
            async with lead._connection() as raw:
                await lead.store.arm_markers(raw, lead.consumer, runs)
            for p, run in unarmed:
                p._committed(Marker(run[0].offset, run[-1].offset, 1, None))
        ahead = [_ahead(run) for _, run in members]
        for (p, _), marker in zip(members, ahead, strict=True):
            p._mine.add(_span_of(marker))
        arm = [p._arm(marker) for (p, _), marker in zip(members, ahead, strict=True)]
        try:
            fresh, unique = await _transaction(lead.connections, members, arm)
        except _Stop as stop:
            if stop.at is not None:
                p, run = members[stop.at[0]]
                p._failed = (run[stop.at[1]].offset, stop.cause)
            else:
                for p, _ in members:
                    p._solo = True
            return
    except BaseException:
        for p, _ in members:
            p._forget()
        raise
    for (p, run), marker in zip(members, ahead, strict=True):
        p._committed(marker)
        p._count_claimed(run, fresh, unique)
        await p._progress(run[-1])


async def _transaction(
    connections: Connections,
    members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]],
    arm: Sequence[Arm],
) -> tuple[set[str], dict[str, InboxEvent]]:
    """One transaction for the members' runs: claim every event (arming ``arm`` in the same
    statement), run the handlers of the new ones, each member's in offset order, commit.

    Returns the new event ids and the copy of each id that was claimed (the same event
    twice, in one fetch or in two partitions: only the first copy runs). Anything failing
    rolls the transaction back and raises :class:`_Stop`.
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
            for handler, group in _groups(members, fresh, unique, lead.config.handler_max_batch):
                if not handler.batch:
                    ((m, i, p, event),) = group
                    at = (m, i)
                    await p._run_handler(event, session, raw=held.raw)
                    continue
                # A failed call is pinned on one event only when the handler (or the
                # parsing of one event) says which: else the split finds it (_savepointed).
                at, blame = None, _Blame()
                try:
                    await lead._run_batch(handler, [e for *_, e in group], session, held.raw, blame)
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
            raise _Stop(at, exc) from exc
    finally:
        await connections.give(held)
    lead.metrics.transactions()
    return fresh, unique


# One step of a transaction: a handler and the events of one call (one event, unless it is
# a batch handler), each with its member's position, the event's in its run, its processor.
Placed = tuple[int, int, "PartitionProcessor", InboxEvent]


def _groups(
    members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]],
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
    for m, (p, run) in enumerate(members):
        route = p._route
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
            group.append((m, i, p, event))
    if current is not None:
        yield current, group


@dataclass
class _Blame:
    """Which event of a batch handler's list a failure belongs to (None: not known)."""

    index: int | None = None


def _pinned(
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

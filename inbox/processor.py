"""Handling the records of one partition, in offset order, effectively once.

A *run* is a contiguous slice of a partition's records handled in one transaction (up to
``max_batch_records`` of them, or one in ``transaction_per="event"`` mode). Before any of
its handlers starts, the partition's durable attempt marker must say "run [first, last]
started" (attempts > 0), committed; the run's own commit moves the marker on. So a marker
still armed when the same offsets come back means the run never finished — the process
died inside a handler, or was killed. That is how attempts are counted durably without one
extra commit per event; how the marker costs almost nothing on the hot path (cached, armed
ahead by the previous commit) is ``inbox/marker.py``.

:class:`PartitionProcessor` decides which path each run takes:

* the fast path, one transaction per run (``inbox/transaction.py``, which also holds the
  shared transaction of several partitions' short runs, :func:`process_together`);
* when that fails, or a run has records needing the consumer's policy, the careful path
  (``inbox/careful.py``): a savepoint per event, then the failing event retried alone with
  a durable attempt count per try and full-jitter backoff, keeping the partition's order;
* after a crash (a marker still armed by a run that never finished), the records of the
  unfinished run one per transaction, so the event that kills the process is isolated
  and, after its attempts are used up, dead-lettered without running again.

The handlers themselves are called by ``inbox/dispatch.py``.

Database errors are judged by their SQLSTATE (``outbox/dberrors.py``) before a handler's
rules, wherever they were raised (the claim, a handler's own INSERT, the commit): an
outage rolls the transaction back and leaves :meth:`PartitionProcessor.process` as
``DatabaseUnavailable`` (the lane backs off; no event is charged), and a conflict runs the
event's attempt again at once. Fast-path runs need nothing more after an outage: a marker
this process armed with one attempt and no error is already known as its own
(:attr:`inbox.marker.AttemptMarker.ours`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from inbox import failures
from inbox.app import Consumer
from inbox.careful import CarefulPath, RetryAlone
from inbox.connections import Connections
from inbox.dead_lettering import DeadLetterer, DeadLetterSink
from inbox.dispatch import Dispatch, trace_duplicates
from inbox.event import InboxEvent
from inbox.marker import KEEP, AtCommit, AttemptMarker, KeepMarker, NotRead, ahead, span
from inbox.metrics import Metrics
from inbox.store import InboxStore, Marker
from inbox.transaction import RolledBack, transaction
from outbox.dberrors import is_conflict
from outbox.resilience.retry import RetryPolicy
from outbox.settings import ConsumerSettings

# (after_offset, limit) -> up to ``limit`` queued records with a higher offset, in order.
Queued = Callable[[int, int], Sequence[InboxEvent]]


@dataclass
class PartitionProcessor:
    app: Consumer
    config: ConsumerSettings
    store: InboxStore
    # The careful paths' sessions (savepoints, retries alone, dead letters).
    sessions: async_sessionmaker[AsyncSession]
    # Connections kept open in autocommit mode: one statement = one durable commit, one
    # round trip (the marker writes that must commit before handlers run). The fast runs'
    # and shared transactions are opened on them by their claim (see inbox/transaction.py).
    connections: Connections
    sink: DeadLetterSink
    policy: RetryPolicy
    metrics: Metrics
    topic: str
    partition: int
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # Called after each database commit with the next offset to consume.
    on_progress: Callable[[int], Awaitable[None]] | None = None
    # (offset, error) of the handler that failed in a shared transaction, to resume from.
    _resume_from: tuple[int, Exception] | None = field(default=None, init=False)
    # A shared transaction failed where no handler raised (the final flush, the commit):
    # run alone next, where a savepoint per event finds the culprit, instead of sharing
    # (and failing) again.
    _unshared: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.dispatch = Dispatch(self.app, self.config, self.store, self.metrics, self.topic)
        self.marker = AttemptMarker(
            self.store, self.connections, self.app.name, self.topic, self.partition
        )
        dead = DeadLetterer(self.app.name, self.config, self.store, self.sink, self.metrics)
        self.careful = CarefulPath(
            self.sessions,
            self.store,
            self.config,
            self.policy,
            self.metrics,
            self.dispatch,
            self.marker,
            dead,
            self.stopping,
            self._progress,
        )

    @property
    def consumer(self) -> str:
        return self.app.name

    # ------------------------------------------------------------------ driver

    async def process(self, queued: Queued, wanted: Callable[[], bool] | None = None) -> int:
        """Handle queued records in runs until none is left (or ``4 * max_batch_records``
        were finished, or ``wanted()`` says another partition waits for the slot, after
        any run); return how many finished.

        Stops early (between runs, or during a retry's backoff) when ``stopping`` is set;
        the caller re-reads the rest from Kafka.
        """
        size = 1 if self.config.transaction_per == "event" else self.config.max_batch_records
        budget = 4 * self.config.max_batch_records
        self._unshared = False
        try:
            await self.marker.load()
            done = 0
            run = queued(-1, size)
            if self._resume_from is not None and run:
                offset, cause = self._resume_from
                self._resume_from = None
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
                if wanted is not None and wanted():
                    break
                if n == len(run) and following and self.marker.ready == span(following):
                    run = following  # exactly the run the marker was armed for
                else:
                    run = queued(run[n - 1].offset, size)
            return done
        except BaseException:
            # A failed or cancelled commit leaves the marker's durable state unknown.
            self.forget()
            raise

    def forget(self) -> None:
        """An error (or a cancellation) left the marker's durable state unknown."""
        self.marker.forget()
        self._resume_from = None

    def resume_next(self, offset: int, cause: Exception) -> None:
        """The handler at ``offset`` failed in a shared transaction: the next
        :meth:`process` resumes from that failure."""
        self._resume_from = (offset, cause)

    def alone_next(self) -> None:
        """A shared transaction failed where no handler raised: the next run is not
        offered to share (see :meth:`ready_run`)."""
        self._unshared = True

    async def release(self) -> None:
        """Disarm a marker armed ahead: before letting go of the partition (or the next
        owner would take it for a crash), or when the partition has gone quiet."""
        try:
            await self.marker.release()
        except BaseException:
            self.forget()
            raise

    @property
    def armed_ahead(self) -> bool:
        """Whether a marker this process armed may still be set (see :meth:`release`)."""
        return self.marker.armed_ahead

    def ready_run(self, queued: Queued) -> Sequence[InboxEvent] | None:
        """Everything queued, if it can join a shared transaction: a short run (all the
        partition has) on the fast path, its marker unarmed or armed by this process for
        it, nothing to recover or resume."""
        if (
            self.config.transaction_per != "batch"
            or self.stopping.is_set()
            or isinstance(self.marker.known, NotRead)
            or self._resume_from is not None
            or self._unshared
        ):
            return None
        run = queued(-1, self.config.max_batch_records)
        if not run or queued(run[-1].offset, 1) or any(self.dispatch.needs_policy(e) for e in run):
            return None
        armed = self.marker.ready if self.marker.covers(run) else None
        known = self.marker.known
        if armed is None and known is not None and known.attempts > 0:
            return None  # armed by a crashed owner (recovery) or for another run
        first, last = armed or span(run)
        if first == last and self.dispatch.max_attempts(run[0]) < 2:
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
        if isinstance(result, RetryAlone):
            return await self.careful.retry_alone(run, result)
        return result

    async def _step(self, run: Sequence[InboxEvent], following: Sequence[InboxEvent]) -> int:
        if self.marker.ready is not None:
            # The marker is ours: skip writing it if it already covers exactly this run.
            return await self._batch(run, following, marked=self.marker.covers(run))
        prev = self.marker.known
        assert not isinstance(prev, NotRead)
        if prev is not None and prev.attempts > 0:
            first = run[0].offset
            if first < prev.start_offset:
                # Records before the unfinished run were finished before it started (they
                # are inbox duplicates now); the marker is left for the run itself.
                before = [e for e in run if e.offset < prev.start_offset]
                return await self._batch(before, (), marked=True, keep=True)
            if first == prev.start_offset:
                # The run over these offsets never finished: it may have killed the
                # process. Handle its records one at a time.
                return await self._recover(run, prev)
        return await self._batch(run, following, marked=False)

    async def _recover(self, run: Sequence[InboxEvent], prev: Marker) -> int:
        crashed = [e for e in run if e.offset <= prev.end_offset]
        if prev.start_offset == prev.end_offset:
            cut = self.marker.interrupted
            if cut is not None and cut.marker == prev:
                # Not a crash: the database interrupted this process's own attempt (see
                # inbox.marker.Interrupted). Take it up again as the same attempt.
                if cut.failure is not None:
                    await self.careful.dead_letter(crashed[0], cut.failure, cut.prior)
                    return 1
                again = await self.careful.run_alone(
                    crashed[0], cut.prior, cut.last_error, charge=cut.charge, resume=True
                )
                return int(again)
            # A single-record marker counts that record's attempts exactly.
            return int(await self.careful.run_alone(crashed[0], prev.attempts, prev.last_error))
        # A batch marker says only that the batch died somewhere in it. Each of its
        # records runs alone; the one that dies again is charged the batch run as well,
        # so a process-killing handler runs exactly max_attempts times (for N >= 2).
        done = 0
        for event in crashed:
            if not await self.careful.run_alone(event, 0, None, charge=1):
                break
            done += 1
        return done

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
            await self.marker.mark(Marker(run[0].offset, run[-1].offset, 1, None), ready=True)
        at_commit: AtCommit = ahead(run)
        if keep:
            at_commit = KEEP
        elif following:
            at_commit = Marker(following[0].offset, following[-1].offset, 1, None)
        result = await self._chunk(run, at_commit)
        if isinstance(result, RetryAlone):
            return await self.careful.retry_alone(run, result)
        return result

    async def _chunk(self, chunk: Sequence[InboxEvent], at_commit: AtCommit) -> int | RetryAlone:
        self.marker.arming(at_commit)
        if not any(self.dispatch.needs_policy(e) for e in chunk):
            try:
                return await self._fast(chunk, at_commit)
            except RolledBack as stop:
                if stop.at is not None:
                    return await self._failed_at(chunk, stop.at[1], stop.cause)
        return await self.careful.savepointed(chunk, at_commit)

    async def _failed_at(
        self, chunk: Sequence[InboxEvent], index: int, cause: Exception
    ) -> int | RetryAlone:
        """The fast run failed in the handler of ``chunk[index]``: that was the event's
        first attempt. Commit the events before it; it continues alone (retried, or
        dead-lettered)."""
        failure = failures.classify(cause, self.config.error_message_chars)
        if index:
            done = await self._prefix(chunk[:index])
            if done < index:
                return done
        return RetryAlone(index, failure, 0 if is_conflict(cause) else 1)

    async def _prefix(self, chunk: Sequence[InboxEvent]) -> int:
        result = await self._chunk(chunk, KEEP)
        if isinstance(result, RetryAlone):
            # Cannot happen with deterministic handlers; treat as a fresh failure there.
            return await self.careful.retry_alone(chunk, result)
        return result

    async def _fast(self, chunk: Sequence[InboxEvent], at_commit: AtCommit) -> int:
        """One transaction, no savepoints. Raises RolledBack if anything failed."""
        arm = [] if isinstance(at_commit, KeepMarker) else [self.marker.arm(at_commit)]
        fresh, unique = await transaction(self.connections, [(self.dispatch, chunk)], arm)
        await self.committed_run(chunk, at_commit, fresh, unique)
        return len(chunk)

    async def committed_run(
        self,
        run: Sequence[InboxEvent],
        at_commit: AtCommit,
        fresh: Collection[str],
        unique: dict[str, InboxEvent],
    ) -> None:
        """A fast transaction (this partition's, or shared) committed ``run`` and
        ``at_commit``: mirror the marker, count the new events and the duplicates (see
        :func:`inbox.transaction.transaction` for ``fresh`` and ``unique``), move on."""
        self.marker.committed(at_commit)
        new = sum(1 for e in run if e.event_id in fresh and unique[e.event_id] is e)
        self.metrics.processed(new)
        self.metrics.duplicates(len(run) - new)
        if new < len(run):
            trace_duplicates(run, fresh, unique, self.consumer)
        await self._progress(run[-1])

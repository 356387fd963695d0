"""A partition's durable attempt marker, as the process owning the partition knows it.

Before any handler of a run starts, the partition's marker must say "run [first, last]
started" (attempts > 0), committed; the run's own commit moves the marker on (see
``inbox/processor.py``). Keeping that marker costs almost nothing on the hot path:

* It is read once per partition assignment and then cached: while this process owns the
  partition, only this process writes it, and every write goes through
  :class:`AttemptMarker`, which updates the cache after the write committed (and forgets
  the cache when an error leaves the database state unknown).
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
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from sqlalchemy.ext.asyncio import AsyncSession

from inbox.connections import Connections
from inbox.event import InboxEvent
from inbox.failures import Failure
from inbox.store import Arm, Driver, InboxStore, Marker

# How many offsets past a finished run its commit arms the marker for (see the docstring).
AHEAD = 32


class KeepMarker(enum.Enum):
    """Leave the attempt marker as it is (records known to be finished already)."""

    KEEP = 0


KEEP = KeepMarker.KEEP
# What a run's commit does to the marker: arm it (for the next run, or ahead), or KEEP it.
AtCommit = Marker | KeepMarker


class NotRead(enum.Enum):
    """The marker has not been read since the partition was assigned (or an error left
    its durable state unknown): :meth:`AttemptMarker.load` reads it."""

    UNREAD = 0


UNREAD = NotRead.UNREAD


@dataclass(frozen=True)
class Interrupted:
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
class AttemptMarker:
    """The cache of one partition's durable marker, and every write of it."""

    store: InboxStore
    # Connections kept open in autocommit mode: one statement = one durable commit, one
    # round trip (the marker writes that must commit before handlers run).
    connections: Connections
    consumer: str
    topic: str
    partition: int
    # The durable marker as last read or committed by this process (see module docstring).
    known: Marker | NotRead | None = field(default=UNREAD, init=False)
    # (first, last) when the durable marker is armed (attempts 1) for a run this process
    # has not started yet, or started without it killing the process: such a marker is
    # ours, not evidence of a crash.
    ready: tuple[int, int] | None = field(default=None, init=False)
    # Spans this process armed (one attempt, no error) whose write may have reached the
    # database. When an error leaves the durable state unknown, a marker re-read with one
    # of these spans is ours: a process that is still alive did not crash under it.
    ours: set[tuple[int, int]] = field(default_factory=set, init=False)
    # The careful attempt the database interrupted (see Interrupted); outlives forget().
    interrupted: Interrupted | None = field(default=None, init=False)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Driver]:
        """A held connection for autocommit statements (each commits on its own)."""
        held = await self.connections.take()
        try:
            yield held.raw
        finally:
            await self.connections.give(held)

    async def load(self) -> None:
        """Read the durable marker unless it is known (cached)."""
        if self.known is not UNREAD:
            return
        async with self.connection() as raw:
            marker = await self.store.marker(raw, self.consumer, self.topic, self.partition)
        self.known = marker
        self.ready = None
        if (
            marker is not None
            and marker.attempts == 1
            and marker.last_error is None
            and span_of(marker) in self.ours
        ):
            self.ready = span_of(marker)
        self.ours = {self.ready} if self.ready else set()

    def forget(self) -> None:
        """An error left the durable state unknown: read it again before the next run."""
        self.known, self.ready = UNREAD, None

    def covers(self, run: Sequence[InboxEvent]) -> bool:
        """Whether the marker is armed by this process for ``run`` already."""
        return covers(self.ready, run)

    async def mark(self, marker: Marker, *, ready: bool = False) -> None:
        """Commit ``marker`` on its own, before the handlers it guards run. ``ready``: it
        is armed for a fast-path run (else it counts a careful attempt)."""
        if ready:
            self.ours.add(span_of(marker))
        async with self.connection() as raw:
            await self.store.set_marker(raw, self.consumer, self.topic, self.partition, marker)
        if ready:
            self.committed(marker)
        else:
            self.known, self.ready, self.ours = marker, None, set()

    def arming(self, at_commit: AtCommit) -> None:
        """``at_commit`` is about to be written: until that is known to have committed (or
        not), a marker read back with its span is ours."""
        if not isinstance(at_commit, KeepMarker):
            self.ours.add(span_of(at_commit))

    def arm(self, marker: Marker) -> Arm:
        """``marker`` (armed: one attempt, no error) for a claim's ``arm``."""
        assert marker.attempts == 1 and marker.last_error is None
        return self.topic, self.partition, marker.start_offset, marker.end_offset

    async def write_at_commit(self, session: AsyncSession, at_commit: AtCommit) -> None:
        """Add the marker change ``at_commit`` to the run's transaction."""
        if not isinstance(at_commit, KeepMarker):
            await self.store.set_marker(
                session, self.consumer, self.topic, self.partition, at_commit
            )

    async def finish(self, session: AsyncSession) -> None:
        """Add "the run is finished" to ``session``'s transaction (then :meth:`finished`)."""
        await self.store.finish_marker(session, self.consumer, self.topic, self.partition)

    def committed(self, at_commit: AtCommit) -> None:
        """Mirror a committed ``at_commit`` in the cache."""
        if not isinstance(at_commit, KeepMarker):
            self.known = at_commit
            self.ready = span_of(at_commit)
            self.ours = {self.ready}
            self.interrupted = None

    def finished(self) -> None:
        """Mirror a committed "finished" (attempts 0) in the cache."""
        if isinstance(self.known, Marker):
            self.known = replace(self.known, attempts=0, last_error=None)
        self.ready, self.ours, self.interrupted = None, set(), None

    @property
    def armed_ahead(self) -> bool:
        """Whether a marker this process armed may still be set (see :meth:`release`)."""
        return bool(self.ours)

    async def release(self) -> None:
        """Disarm a marker armed ahead: before letting go of the partition (or the next
        owner would take it for a crash), or when the partition has gone quiet."""
        if not self.ours:
            return
        async with self.connection() as raw:
            for span in self.ours:  # one, or two when an error hid which one is durable
                await self.store.disarm_marker(raw, self.consumer, self.topic, self.partition, span)
        self.finished()


async def arm_together(uncovered: Sequence[tuple[AttemptMarker, Sequence[InboxEvent]]]) -> None:
    """Arm each marker for its run (several partitions of one consumer), in one autocommit
    statement on the first one's connection."""
    for marker, run in uncovered:
        marker.ours.add(span(run))
    lead = uncovered[0][0]
    runs = [(m.topic, m.partition, run[0].offset, run[-1].offset) for m, run in uncovered]
    async with lead.connection() as raw:
        await lead.store.arm_markers(raw, lead.consumer, runs)
    for marker, run in uncovered:
        marker.committed(Marker(run[0].offset, run[-1].offset, 1, None))


def span(run: Sequence[InboxEvent]) -> tuple[int, int]:
    return run[0].offset, run[-1].offset


def span_of(marker: Marker) -> tuple[int, int]:
    return marker.start_offset, marker.end_offset


def covers(span: tuple[int, int] | None, run: Sequence[InboxEvent]) -> bool:
    """Whether a marker armed for ``span`` covers ``run`` (it must start where the run
    does: records before its start are not guarded by it)."""
    return span is not None and span[0] == run[0].offset and run[-1].offset <= span[1]


def ahead(run: Sequence[InboxEvent]) -> Marker:
    """The marker a run's commit leaves when the next run is not in hand yet."""
    after = run[-1].offset + 1
    return Marker(after, after + AHEAD - 1, 1, None)

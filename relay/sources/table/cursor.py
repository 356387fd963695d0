"""Where each lane's claim may start: the claim horizon and the per-lane cursors (pure logic;
the SQL is in ``relay/sources/table/store.py``, the readings come from
``relay/sources/table/horizon.py``).

While a long transaction holds a snapshot, VACUUM cannot remove the rows the relay deleted
(or marked published), and a claim that starts at the beginning of its lane walks all of
them. A claim that starts at ``cursor[lane]`` walks only what was published since. The
cursor may only pass ids that can never again be pending; docs/concepts/claim-cursor.md has
the argument in full, the short form is:

* **Horizon.** Ids come from the table's identity sequence. An INSERT takes
  RowExclusiveLock on the table when it is parsed (or, for a cached plan, before it runs),
  before it calls ``nextval()``, and holds it until its transaction ends. So a reading of
  the sequence's last value S, followed (in a later statement) by the set W of virtual
  transactions holding that lock, covers every unfinished writer of an id <= S. Once no
  member of W is left (a later reading), every id <= S is final: committed rows are visible
  to any later snapshot, aborted ones never will be. A read-only snapshot (``pg_dump``, a
  report in REPEATABLE READ) holds no such lock and does not stop the horizon; a transaction
  that *wrote* the outbox and stays open does.
* **Cursor.** After a claim transaction, for each lane it held the fence of, the probe
  statement says which is the lowest id in (cursor, horizon] that is still pending to that
  transaction (rows it claimed itself are not: it deleted or marked them). Everything below
  it is published, claimed by this batch, or aborted; the cursor moves up to it, but never
  past a row of this batch that Kafka did not acknowledge (it may be back in the outbox).
  Rows that wait (``available_at`` in the future: producer delays, backoff) are pending to
  the probe, so the cursor stops below them until they are published.
* Cursors are facts about the database, not about ownership: the fence serializes every
  claim transaction of a lane across relays, and a row can only become pending again by a
  put-back in a fenced transaction that claimed it while it was pending. So a cursor stays
  valid when its lane moves to another relay and back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# "Unknown": the claim scans the lane from its start (as it did before cursors existed).
LANE_START = -(2**63)
# Readings still waiting for their writers to finish; when more pile up (a writer stays
# open), the newest replaces the last one kept, so the horizon jumps to a recent value as
# soon as the writer ends.
MAX_OPEN_READINGS = 64


@dataclass(frozen=True)
class Reading:
    last_id: int  # the sequence's last value
    writers: frozenset[str]  # virtual transactions holding RowExclusiveLock, read after it
    at: float  # monotonic time of the reading


class Horizon:
    """The highest id H such that every transaction that took an id <= H has ended."""

    def __init__(self) -> None:
        self.value: int | None = None
        self.reached_at: float | None = None  # when the reading that gave ``value`` was taken
        self._open: deque[Reading] = deque()
        self._last_id: int | None = None

    def observe(self, reading: Reading) -> bool:
        """Take a reading; False when the sequence went backwards (``setval``, RESTART,
        table re-created): ids may be handed out again, so nothing known holds any more."""
        if self._last_id is not None and reading.last_id < self._last_id:
            self.reset()
            self._last_id = reading.last_id
            return False
        self._last_id = reading.last_id
        if len(self._open) >= MAX_OPEN_READINGS:
            self._open.pop()
        self._open.append(reading)
        # A writer still running now held the lock continuously since every earlier reading
        # that saw it, so readings resolve in order: stop at the first one still waiting.
        while self._open and not (self._open[0].writers & reading.writers):
            done = self._open.popleft()
            if self.value is None or done.last_id >= self.value:
                self.value, self.reached_at = done.last_id, done.at
        return True

    def blockers(self, writers: frozenset[str]) -> frozenset[str]:
        """Of ``writers`` (the latest reading), those the oldest open reading waits for."""
        return self._open[0].writers & writers if self._open else frozenset()

    @property
    def waiting_since(self) -> float | None:
        """When the oldest reading still waiting for its writers was taken."""
        return self._open[0].at if self._open else None

    def reset(self) -> None:
        self.value = self.reached_at = self._last_id = None
        self._open.clear()


def settled(horizon: int, first_pending: int | None, first_unacked: int | None) -> int:
    """How far a lane's cursor may move after a fenced claim transaction: up to the horizon,
    below the first row still pending to it, below the first row of its batch that Kafka did
    not acknowledge."""
    bound = horizon
    if first_pending is not None:
        bound = min(bound, first_pending - 1)
    if first_unacked is not None:
        bound = min(bound, first_unacked - 1)
    return bound


@dataclass(frozen=True)
class ClaimStart:
    """What one claim is sent with: where each of its lanes starts, and the horizon known
    then (None: no horizon yet, so the claim cannot move any cursor)."""

    lanes: list[int]
    after: list[int]
    horizon: int | None
    generation: int

    @property
    def behind(self) -> list[tuple[int, int]]:
        """(lane, cursor) of the lanes whose cursor the horizon has passed: the only ones a
        probe can move (none while no id moves)."""
        if self.horizon is None:
            return []
        return [
            (lane, a) for lane, a in zip(self.lanes, self.after, strict=True) if a < self.horizon
        ]


class ClaimCursors:
    """One relay's horizon and lane cursors, shared by its pipelines and tasks."""

    def __init__(self) -> None:
        self.horizon = Horizon()
        self._after: dict[int, int] = {}
        # Bumped whenever cursors are forgotten, so that a claim sent before cannot bring
        # one back (computed against an old sequence, or past a stranded row).
        self._generation = 0

    def start(self, lanes: Sequence[int]) -> ClaimStart:
        return ClaimStart(
            list(lanes),
            [self._after.get(lane, LANE_START) for lane in lanes],
            self.horizon.value,
            self._generation,
        )

    def known(self) -> dict[int, int]:
        return dict(self._after)

    def observe(self, reading: Reading) -> bool:
        """A horizon reading; a sequence that went backwards forgets every cursor too."""
        if not self.horizon.observe(reading):
            self.forget()
            return False
        return True

    def settle(
        self,
        start: ClaimStart,
        first_pending: Mapping[int, int | None],
        unacked: Iterable[tuple[int, int]],
    ) -> None:
        """After a claim transaction ended (committed, or rolled back on purpose).

        ``first_pending``: the probe's answer for each lane whose fence the transaction
        held; ``unacked``: (lane, id) of the batch's rows Kafka did not acknowledge.
        """
        if start.horizon is None or start.generation != self._generation:
            return
        back: dict[int, int] = {}
        for lane, row_id in unacked:
            back[lane] = min(row_id, back.get(lane, row_id))
        for lane, pending in first_pending.items():
            bound = settled(start.horizon, pending, back.get(lane))
            if bound > self._after.get(lane, LANE_START):
                self._after[lane] = bound

    def stranded(self, before: Mapping[int, int], lowest_pending: Mapping[int, int]) -> list[int]:
        """Safety net: lanes with a pending row at or below the cursor they had (``before``,
        taken before the rows were counted). By the rules above there is none; one means a
        writer outside them (an explicit old id, a row marked unpublished by hand). Those
        lanes' cursors are forgotten, so their next claim scans from the start."""
        lanes = sorted(
            lane
            for lane, lowest in lowest_pending.items()
            if lane in before and lowest <= before[lane]
        )
        self.forget(lanes)
        return lanes

    def forget(self, lanes: Iterable[int] | None = None) -> None:
        """Back to "unknown" (all lanes when None). Claims already sent settle nothing."""
        self._generation += 1
        if lanes is None:
            self._after.clear()
            return
        for lane in lanes:
            self._after.pop(lane, None)

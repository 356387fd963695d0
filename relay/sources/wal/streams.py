"""The WAL source's bookkeeping between reading and publishing: the key-disjoint streams the
slot's events are split over, the positions the slot may confirm once they are settled, and
the read loop's wake-up."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from relay.event import Event


def observed(task: asyncio.Future[None]) -> None:
    """A batch's failure is raised where the stream is waited for; one cancelled after a
    failure elsewhere is read here, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class KeyStream:
    """One key-disjoint share of the slot's events: the batch being filled, and the one
    being published (at most one at a time, so the stream's events stay in order)."""

    def __init__(self) -> None:
        self.rows: list[Event] = []
        self.bytes = 0
        self.sending: asyncio.Task[None] | None = None
        self.handed = 0  # batches handed over to publish
        self.done = 0  # of those, settled (acknowledged or moved to failed), in order
        # Settled out of order: a batch whose events wait for a held partition
        # (relay/sources/wal/held.py) settles after the batches published after it.
        self._later: set[int] = set()

    @property
    def free(self) -> bool:
        return self.sending is None or self.sending.done()

    def settle(self, number: int) -> None:
        """Batch ``number`` is settled; ``done`` counts those settled with every one
        before them (a batch given up on stopping is never settled: the count stays)."""
        self._later.add(number)
        while self.done + 1 in self._later:
            self.done += 1
            self._later.discard(self.done)

    async def settled(self) -> None:
        """Until the batch being published is settled (its failure raised here)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            await sending


class Mark(NamedTuple):
    """A position the slot may confirm once every stream has settled ``needs[i]`` batches
    (those holding every event read before it)."""

    lsn: int
    needs: tuple[int, ...]
    oldest: float | None  # commit time (Unix) of the first transaction since the last mark


def needs(streams: list[KeyStream]) -> tuple[int, ...]:
    """Per stream, the batches to settle before what was read so far is: those handed
    over, and the one filling."""
    return tuple(st.handed + (1 if st.rows else 0) for st in streams)


class Wake:
    """The read loop's idle wait, cut short when a batch settles or the relay stops."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None

    def arm(self) -> asyncio.Future[None]:
        self.future = asyncio.get_running_loop().create_future()
        return self.future

    def nudge(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

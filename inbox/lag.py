"""The consumer's lag (``outbox_inbox_lag_records``): per assigned partition, the high
watermark minus the offset this member committed (or started from), refreshed once a
second from what the fetches already brought back (the client keeps each partition's last
high watermark). A partition paused for backpressure is not fetched, so its end offset is
asked for with the periodic Kafka check instead: at most one request a second, in a task of
its own (a hung broker cannot hold up the check), never one per event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from inbox.metrics import Metrics
from outbox.errors import OutboxError
from outbox.kafka.client import Consumer, Partition

END_OFFSETS_TIMEOUT_SECONDS = 5.0


@dataclass
class ConsumerLag:
    metrics: Metrics
    # What the last rebalance gave this member, until revoked. Lag is exported for these
    # only: the client keeps reporting revoked partitions in assignment() until the next
    # assignment arrives, and a series made for one then would never be removed.
    assigned: set[Partition] = field(default_factory=set)
    # End offsets of paused partitions, asked for by the Kafka check.
    _end_offsets: dict[Partition, int] = field(default_factory=dict)

    async def paused_end_offsets(self, kafka: Consumer, handled: Container[Partition]) -> None:
        """Paused partitions are not fetched, so their high watermark would stand still."""
        paused = [tp for tp in kafka.paused() if tp in handled]
        if not paused:
            return
        with contextlib.suppress(OutboxError, TimeoutError):
            ends = await asyncio.wait_for(kafka.end_offsets(paused), END_OFFSETS_TIMEOUT_SECONDS)
            self._end_offsets.update((tp, end) for tp, end in ends.items() if tp in handled)

    async def update(self, kafka: Consumer, committed: Mapping[Partition, int]) -> None:
        """Export each assigned partition's lag: high watermark - committed offset."""
        for tp in self.assigned & kafka.assignment():
            high = kafka.highwater(tp)
            asked = self._end_offsets.get(tp)
            if asked is not None:
                high = asked if high is None else max(high, asked)
            if high is None:
                continue  # not fetched yet
            done = committed.get(tp)
            if done is None:
                # Nothing handed over since it was assigned: the position is still where the
                # group's committed offset put it (it is valid once a fetch came back; the
                # timeout only guards the loop against a reset in between).
                try:
                    done = await asyncio.wait_for(kafka.position(tp), 0.1)
                except TimeoutError:
                    continue
                if done is None:
                    continue  # no longer assigned, or being reset
            self.metrics.lag(tp.topic, tp.partition, max(high - done, 0))

    def forget(self, tp: Partition) -> None:
        """Released: the next owner reports this partition's lag."""
        self.assigned.discard(tp)
        self._end_offsets.pop(tp, None)
        self.metrics.forget_lag(tp.topic, tp.partition)

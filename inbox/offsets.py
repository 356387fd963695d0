"""The consumer's offset committer: finished offsets to Kafka, coalesced, off the hot path.

Offsets are committed only after the database commit that finished them, never by
auto-commit. A lane says an offset is done (:meth:`OffsetCommitter.done`); the committer
task (:meth:`OffsetCommitter.run`, started and watched by the daemon) sends the newest
offset of every partition that moved in one request at most every
``offset_commit_interval_ms``, so a handler never waits for a Kafka round trip. A commit
Kafka did not take keeps its offsets for the next try (a newer one finished meanwhile
wins); a partition the group refused (it moved to another member) does not hold up the
others'. It also keeps, per partition, the offset last committed or started from: the
consumer's lag is the high watermark minus that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from outbox.errors import BrokerRefused, BrokerUnavailable, CommitRefused
from outbox.kafka.client import Partition as TopicPartition
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy

log = logging.getLogger("outbox.inbox")


class Committing(Protocol):
    """What the committer needs of a consumer (outbox/kafka/client.py's ``commit``)."""

    async def commit(self, offsets: dict[TopicPartition, int]) -> None: ...


@dataclass
class OffsetCommitter:
    kafka: Dependency  # an outage is one line down, one line up
    policy: RetryPolicy  # the backoff after a commit Kafka did not take
    interval_ms: int  # offset_commit_interval_ms
    consumer: Committing | None = None  # set once the consumer started
    # Per partition: the offset this member last committed, or started from (for lag).
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    _pending: dict[TopicPartition, int] = field(default_factory=dict, init=False)
    _ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def started(self, tp: TopicPartition, offset: int) -> None:
        """The first record fetched for ``tp``: where this member started (for lag)."""
        self.committed.setdefault(tp, offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        """``offset`` is the next one to read for ``tp``: every record before it committed."""
        self._pending[tp] = offset
        self._ready.set()

    def forget(self, tp: TopicPartition) -> None:
        """The partition was released: the next owner reports its lag."""
        self.committed.pop(tp, None)

    async def run(self) -> None:
        """Commit the newest finished offsets, coalesced: one request covers every
        partition that moved in the last ``interval_ms``. A failed commit is tried again
        after a backoff. Runs until cancelled."""
        pause = self.interval_ms / 1000
        failures = 0
        while True:
            await self._ready.wait()
            if await self.flush():
                failures = 0
                await asyncio.sleep(pause)
            else:
                failures += 1
                await asyncio.sleep(max(pause, self.policy.backoff(min(failures, 10))))

    async def flush(self, only: Sequence[TopicPartition] | None = None) -> bool:
        """Commit what is pending (for ``only`` these partitions); False when Kafka did not
        take it (the offsets stay pending)."""
        self._ready.clear()
        picked = {tp: off for tp, off in self._pending.items() if only is None or tp in only}
        for tp in picked:
            del self._pending[tp]
        try:
            return not picked or await self._commit(picked)
        except asyncio.CancelledError:
            # The committer is cancelled at shutdown, maybe while Kafka has the request:
            # the offsets go back so that the daemon's release() commits them (again: a
            # commit is idempotent) instead of the next owner re-reading what was finished.
            self._keep_pending(picked)
            raise

    def _keep_pending(self, offsets: dict[TopicPartition, int]) -> None:
        """Offsets for the next commit; a newer offset finished meanwhile wins."""
        for tp, offset in offsets.items():
            if self._pending.get(tp, -1) < offset:
                self._pending[tp] = offset
        self._ready.set()

    async def _commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """One commit request for every partition that moved; per partition only when the
        group refused it (a partition moved away must not block the others' offsets).
        False when Kafka could not be asked: the offsets are pending again."""
        assert self.consumer is not None
        try:
            await self.consumer.commit(offsets)
            self.committed.update(offsets)
            self.kafka.ok()
            return True
        except CommitRefused as exc:
            if len(offsets) == 1:
                # The partition moved to another member; it re-reads from the last
                # committed offset and the inbox skips what this member already applied.
                log.warning(
                    "offset commit refused",
                    extra={"partitions": sorted(map(str, offsets)), "error": str(exc)},
                )
                return True
        except (BrokerUnavailable, BrokerRefused) as exc:
            # Kafka unreachable, or the group coordinator moved (its broker died) and is
            # not found yet: keep the offsets for the next try — a newer offset finished
            # meanwhile wins — so that a restart re-reads no more than what is uncommitted.
            # One line per outage.
            self._keep_pending(offsets)
            self.kafka.failed(f"offset commit failed: {_cause_name(exc)}")
            return False
        ok = True
        for tp, offset in offsets.items():
            ok = await self._commit({tp: offset}) and ok
        return ok


def _cause_name(exc: BaseException) -> str:
    """The client's own error name behind ``exc`` (what the log line has always said)."""
    return type(exc.__cause__ or exc).__name__

"""Which Kafka partitions can take records now, and which must wait: a sick broker holds
back only the partitions it stalls.

A partition is *stalled* from the moment one of its batches goes unanswered while other
partitions of the same publish were acknowledged (its leader crashed or hangs, or, with
``acks=all``, an in-sync replica it waits for does) until that batch — still queued in the
producer, retried in place by aiokafka — is acknowledged or fails. Meanwhile its rows are
not sent again (they would only queue behind the stuck batch) but go back to the outbox
with a short delay, so that claims pass over them and the rows of other partitions keep
flowing. The delay grows with the stall, from ``MIN_DELAY`` to ``MAX_DELAY``: long enough
that a long outage does not make every claim re-read the partition's backlog, short enough
that its rows follow within ``MAX_DELAY`` once Kafka answers again.

Per-key order. Rows put back with a delay are skipped by claims until it has passed, so a
later row of the same key could be claimed first. Two rules keep that from reaching Kafka:

* the *hold*: a partition's rows are sent again only by a claim that started after every
  row put back for it is due again (``hold_until``), i.e. a claim that sees them all and
  takes them in id order. Rows claimed earlier go back too, due no later than the others.
  (A batch still queued in the producer needs no such care: the producer keeps a
  partition's batches in order and, idempotent, retries one in place — it lands before
  anything sent after it, and a copy of its rows that lands later is a duplicate of rows
  already there, which the inbox drops.)
* the *take-over*: a relay that wins a lane makes the rows its previous owner put back
  with a delay due at once, before its first claim of the lane (under the lane's claim
  fence, so after the old owner's last batch), because it knows nothing of the old
  owner's holds (``Pipeline._take_over``).

A topic that does not exist yet holds its rows the same way, as a whole: they go back for a
few seconds, and once the topic exists no row of it goes out from a claim that started
before they are due again (``topic_missing``) — or rows committed after the topic was
created would reach it before them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from relay.errors import PartitionUnavailable
from relay.kafka.wording import Wording
from relay.metrics import RelayMetrics

log = logging.getLogger("relay.kafka")

MIN_DELAY = 0.2
MAX_DELAY = 0.5
HOLD_MEMORY_SECONDS = 300.0
# Stalls shorter than this are counted (metric) but not logged.
QUIET_SECONDS = 1.0

TopicPartition = tuple[str, int]


@dataclass
class _Stall:
    started: float  # monotonic
    at: datetime  # wall clock, for people
    leader: int | None
    batches: set[asyncio.Future[Any]] = field(default_factory=set)


class PartitionHealth:
    """Stalls and holds of the partitions one relay publishes to (shared by its pipelines)."""

    def __init__(
        self,
        metrics: RelayMetrics,
        wording: Wording,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._waiting = wording.wait
        self._stalls: dict[TopicPartition, _Stall] = {}
        self._holds: dict[TopicPartition, float] = {}
        self._topic_holds: dict[str, float] = {}  # topics found missing: their rows' due time
        # What was last said about each topic: its unavailable partitions (for one log line
        # per change, not one per batch).
        self._reported: dict[str, frozenset[int]] = {}
        self._since: dict[str, tuple[float, datetime]] = {}

    # -- what publish asks ------------------------------------------------------------------
    def refusal(self, tp: TopicPartition, claimed_at: float) -> PartitionUnavailable | None:
        """Why rows of ``tp`` claimed at ``claimed_at`` must not be sent now, or None."""
        now = self._clock()
        stall = self._stalls.get(tp)
        if stall is not None:
            return self._put_back(tp, now, self._delay(stall, now), stall.leader)
        hold = max(self._holds.get(tp, 0.0), self._topic_holds.get(tp[0], 0.0))
        if claimed_at < hold:
            # Put back due when the others are: the claim after that takes them in order.
            return PartitionUnavailable(tp, max(hold - now, 0.0), None)
        return None

    def stalled(
        self, tp: TopicPartition, batch: asyncio.Future[Any], leader: int | None
    ) -> PartitionUnavailable:
        """``batch`` of ``tp`` went unanswered: the partition waits until it is answered."""
        now = self._clock()
        stall = self._stalls.get(tp)
        if stall is None:
            stall = self._stalls[tp] = _Stall(now, datetime.now(UTC), leader)
        stall.batches.add(batch)
        return self._put_back(tp, now, self._delay(stall, now), leader)

    def _put_back(
        self, tp: TopicPartition, now: float, delay: float, leader: int | None
    ) -> PartitionUnavailable:
        # The rows become due within ``delay``; no row of tp goes out before then.
        self._holds[tp] = max(self._holds.get(tp, 0.0), now + delay)
        return PartitionUnavailable(tp, delay, leader)

    def topic_missing(self, topic: str, delay: float) -> None:
        """Rows of ``topic`` went back for ``delay`` seconds: it does not exist (yet)."""
        due = self._clock() + delay
        self._topic_holds[topic] = max(self._topic_holds.get(topic, 0.0), due)

    @staticmethod
    def _delay(stall: _Stall, now: float) -> float:
        return min(MAX_DELAY, max(MIN_DELAY, (now - stall.started) / 8))

    def next_release(self) -> float | None:
        """Seconds until the first hold of a partition that is not stalled (any more) has
        passed — its put-back rows are due and a claim may send them — or None."""
        now = self._clock()
        ahead = [due for tp, due in self._holds.items() if tp not in self._stalls and due > now]
        return min(ahead) - now if ahead else None

    def leaders(self) -> dict[TopicPartition, int | None]:
        """The stalled partitions and the leader each had when it stalled."""
        return {tp: stall.leader for tp, stall in self._stalls.items()}

    # -- stuck batches ------------------------------------------------------------------------
    @property
    def waiting(self) -> list[asyncio.Future[Any]]:
        """The unanswered batches of stalled partitions."""
        return [b for s in self._stalls.values() for b in s.batches if not b.done()]

    def answered(self) -> list[asyncio.Future[Any]]:
        """End the stalls whose batches have all been answered (acknowledged or failed);
        returns the batches answered since the last call (their failures may say the
        producer must be replaced)."""
        done: list[asyncio.Future[Any]] = []
        for tp, stall in list(self._stalls.items()):
            finished = {b for b in stall.batches if b.done()}
            done.extend(finished)
            stall.batches -= finished
            if not stall.batches:
                del self._stalls[tp]
        return done

    def forget(self, batches: Iterable[asyncio.Future[Any]]) -> None:
        """Stop waiting for ``batches`` (their producer was replaced: they may never be
        answered). Their rows are back in the outbox, and holds still apply."""
        gone = set(batches)
        for tp, stall in list(self._stalls.items()):
            stall.batches -= gone
            if not stall.batches:
                del self._stalls[tp]

    # -- what people see ------------------------------------------------------------------------
    def report(self, partitions: dict[str, list[int]]) -> None:
        """The ``outbox_relay_partitions_unavailable`` gauge, and one log line per topic
        whose set of unavailable partitions changed. ``partitions``: each topic's
        partitions (for "3 of 12")."""
        # Holds long past cannot matter to any claim still in flight (a batch ends within
        # the ack timeout); without pruning, every partition ever stalled would stay here.
        horizon = self._clock() - HOLD_MEMORY_SECONDS
        for tp in [tp for tp, hold in self._holds.items() if hold < horizon]:
            del self._holds[tp]
        for topic in [t for t, hold in self._topic_holds.items() if hold < horizon]:
            del self._topic_holds[topic]
        clock = self._clock()
        self._metrics.partitions_unavailable.set(len(self._stalls))
        by_topic: dict[str, dict[int, int | None]] = {}
        first: dict[str, _Stall] = {}
        for (topic, p), stall in self._stalls.items():
            # A blip (a batch a little slower than the grace) is not worth a warning.
            if clock - stall.started >= QUIET_SECONDS:
                by_topic.setdefault(topic, {})[p] = stall.leader
                if topic not in first or stall.started < first[topic].started:
                    first[topic] = stall
        for topic in set(by_topic) | set(self._reported):
            sick = by_topic.get(topic, {})
            now = frozenset(sick)
            if now == self._reported.get(topic, frozenset()):
                continue
            if not now:
                started, _ = self._since.pop(topic)
                log.info(
                    "Kafka partitions of %s available again after %.1f s",
                    topic,
                    self._clock() - started,
                    extra={"topic": topic},
                )
                del self._reported[topic]
                continue
            if topic not in self._since:
                self._since[topic] = (first[topic].started, first[topic].at)
            since = self._since[topic][1].strftime("%H:%M:%S")
            leaders = sorted({str(x) for x in sick.values() if x is not None and x >= 0})
            total = len(partitions.get(topic, ())) or "?"
            log.warning(
                "%d of %s partitions of %s unavailable since %s, leader %s; their %s%s",
                len(now),
                total,
                topic,
                since,
                ", ".join(leaders) or "unknown",
                self._waiting,
                "" if len(now) == total else ", the other partitions keep flowing",
                extra={"topic": topic, "partitions": sorted(now), "leaders": leaders},
            )
            self._reported[topic] = now

    @property
    def unavailable(self) -> int:
        return len(self._stalls)

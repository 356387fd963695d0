"""What a publish outcome does to an event Kafka did not acknowledge, whichever source read
it: the one verdict both sources apply.

* Kafka refused the record itself (:class:`~outbox.errors.RecordRejected`: too large,
  not authorized...): one attempt more; at ``relay.max_attempts`` the event moves to the
  failed table, else it is tried again after a full-jitter backoff.
* Its topic does not exist (:class:`~outbox.errors.TopicMissing`): a deployment state,
  not the event's fault: no attempt counted; it is tried again after
  ``MISSING_TOPIC_RECHECK_SECONDS``, and the topic is asked for again meanwhile.
* Its partition is unavailable (:class:`~relay.errors.PartitionUnavailable`: a sick
  broker): no attempt; tried again after the delay the partition's health chose.
* Anything else is Kafka's trouble as a whole (unreachable, a producer to replace): no
  attempt, and no delay of its own; the source waits for Kafka as it does for every event.

How each source carries the verdict out is its own: the table source puts the row back in
the claiming transaction (or moves it to the failed table there); the WAL source retries
in place, in order, before the slot may move past the event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from outbox.errors import ProducerBroken, RecordRejected, TopicMissing
from outbox.resilience.retry import RetryPolicy
from outbox.settings import RetrySettings
from relay.errors import PartitionUnavailable

# How long the events of a topic Kafka does not have wait before the topic is asked for again.
MISSING_TOPIC_RECHECK_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Verdict:
    attempts: int  # the event's attempts, this outcome counted
    delay: float  # seconds before it is tried again
    failed: bool = False  # attempts used up: it moves to the failed table
    refused: bool = False  # Kafka refused the record itself (counts an attempt)
    kafka_down: bool = False  # Kafka's trouble, not the event's: wait for Kafka


class Verdicts:
    """The verdict for each event of a publish Kafka did not acknowledge.

    ``topic_missing(topic, delay)`` is told of every event whose topic is missing (the
    publisher asks Kafka for the topic again and holds its later events meanwhile)."""

    def __init__(
        self,
        max_attempts: int,
        retry: RetrySettings,
        topic_missing: Callable[[str, float], None],
    ) -> None:
        self.max_attempts = max_attempts
        # Refused records back off with full jitter under relay.max_attempts.
        self._backoff = RetryPolicy(retry.base_seconds, retry.cap_seconds, max_attempts)
        self._topic_missing = topic_missing

    def of(self, failure: Exception, topic: str, attempts: int) -> Verdict:
        """The verdict for an event of ``topic``, refused ``attempts`` times before, that
        failed with ``failure`` (from the publish's outcome)."""
        if isinstance(failure, RecordRejected):
            attempts += 1
            if attempts >= self.max_attempts:
                return Verdict(attempts, 0.0, failed=True, refused=True)
            return Verdict(attempts, self._backoff.backoff(attempts), refused=True)
        if isinstance(failure, TopicMissing):
            self._topic_missing(topic, MISSING_TOPIC_RECHECK_SECONDS)
            return Verdict(attempts, MISSING_TOPIC_RECHECK_SECONDS)
        if isinstance(failure, PartitionUnavailable):
            return Verdict(attempts, failure.delay)
        # A broken producer is replaced by the publisher: its events may go again at once.
        return Verdict(attempts, 0.0, kafka_down=not isinstance(failure, ProducerBroken))

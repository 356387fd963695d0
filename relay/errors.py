"""Errors of the relay (all under the framework's single tree)."""

from __future__ import annotations

from outbox.errors import BrokerUnavailable, ConfigurationError, OutboxError


class RecordRejected(OutboxError):
    """Kafka refuses this record permanently (too large, invalid topic, not authorized).

    Retrying cannot help by itself, so the row's attempts are counted and, after
    ``relay.max_attempts``, the row is moved to the failed table.
    """

    retriable = False


class RecordTooLarge(RecordRejected):
    """The record is larger than the relay (and Kafka) will accept."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"record is {size} bytes, over the relay's limit of {limit} bytes "
            "(max_payload_bytes / broker message.max.bytes)"
        )


class PartitionUnavailable(BrokerUnavailable):
    """Kafka does not answer for one partition (its leader, or an in-sync replica it waits
    for, crashed or hangs): the row goes back to the outbox, no attempt counted, due again
    after ``delay`` seconds; the other partitions are not held up."""

    # How the row's last_error starts (a relay taking over a lane looks for it).
    MARKER = "Kafka partition unavailable: "

    def __init__(self, tp: tuple[str, int], delay: float, leader: int | None) -> None:
        topic, partition = tp
        where = f", leader {leader}" if leader is not None and leader >= 0 else ""
        super().__init__(f"{self.MARKER}{topic}[{partition}]{where}")
        self.tp = tp
        self.delay = delay
        self.leader = leader


class ProducerBroken(OutboxError):
    """The Kafka producer must be recreated (lost idempotence state, fenced, closed)."""

    retriable = True


class SlotMissing(ConfigurationError):
    """The WAL source's replication slot does not exist (at start: not set up yet)."""

    def __init__(self, slot: str) -> None:
        super().__init__(
            f"replication slot {slot!r} does not exist in this database; create it and its "
            "publication with `outbox wal setup` (if it existed before, the events it had "
            "not confirmed are gone: see docs/howto/wal-source.md)"
        )


class SlotLost(ConfigurationError):
    """The slot was dropped or invalidated under the relay: the events it had not
    confirmed may be gone from the WAL. Never re-created silently."""

    def __init__(self, slot: str, since: str | None, cause: str) -> None:
        where = f"since LSN {since}" if since else "(its confirmed LSN is unknown)"
        super().__init__(
            f"replication slot {slot!r} lost ({cause}): events may be lost {where}; "
            "compare what producers committed after that point with the topics, then "
            "recreate the slot with `outbox wal setup` and restart the relay "
            "(docs/howto/wal-source.md)"
        )
        self.since = since

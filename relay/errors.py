"""Errors of the relay (all under the framework's single tree)."""

from __future__ import annotations

from outbox.errors import BrokerUnavailable, ConfigurationError, RecordRejected


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


class SlotMissing(ConfigurationError):
    """The WAL source's replication slot does not exist (at start: not set up yet)."""

    def __init__(self, slot: str, timeline: int | None = None) -> None:
        # A server past timeline 1 was promoted (or restored) at some point: if that was
        # after the slot was made, the slot was lost in a failover, not never set up.
        promoted = (
            f"; this server is on timeline {timeline}: if it was promoted since the slot was "
            "made, the slot was lost in that failover and recreating it skips what came "
            "since (docs/operations/postgresql-failover.md)"
            if timeline is not None and timeline > 1
            else ""
        )
        super().__init__(
            f"replication slot {slot!r} does not exist in this database; create it and its "
            "publication with `outbox wal setup` (if it existed before, the events it had "
            f"not confirmed are gone: see docs/howto/wal-source.md){promoted}"
        )


class SlotLost(ConfigurationError):
    """The slot was dropped or invalidated under the relay: the events it had not
    confirmed may be gone from the WAL. Never re-created silently."""

    def __init__(self, slot: str, since: str | None, cause: str, advice: str | None = None) -> None:
        where = f"since LSN {since}" if since else "(its confirmed LSN is unknown)"
        advice = advice or (
            "compare what producers committed after that point with the topics, then "
            "recreate the slot with `outbox wal setup` (`--recreate-lost` for an invalidated "
            "one) and restart the relay (docs/howto/wal-source.md)"
        )
        super().__init__(
            f"replication slot {slot!r} lost ({cause}): events may be lost {where}; {advice}"
        )
        self.since = since

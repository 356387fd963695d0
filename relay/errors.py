"""Errors of the relay (all under the framework's single tree)."""

from __future__ import annotations

from outbox.errors import OutboxError


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


class ProducerBroken(OutboxError):
    """The Kafka producer must be recreated (lost idempotence state, fenced, closed)."""

    retriable = True

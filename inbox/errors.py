"""Errors of the inbox consumer (all subclasses of :class:`outbox.errors.OutboxError`)."""

from __future__ import annotations

from outbox.errors import ConfigurationError, NotFound, OutboxError


class HandlerConfigurationError(ConfigurationError):
    """A handler or consumer was declared wrongly (duplicate type, bad signature)."""


class ConsumerAppNotFound(ConfigurationError):
    """``outbox consume MODULE:ATTR`` could not import or find the consumer object."""


class RecordTooLargeForTopic(ConfigurationError):
    """Kafka refuses a record on ``topic`` as too large: the topic's ``max.message.bytes``
    (or the broker's ``message.max.bytes``, or this client's ``max_request_size``) is
    below its size. Retrying sends the same bytes again. A dead letter refused so is kept
    in the database with a marker on the topic (nothing stops); a replay stops with it."""

    def __init__(self, topic: str, size: int, error: str) -> None:
        super().__init__(
            f"Kafka refuses the record of {size} bytes on {topic!r}: {error}; raise the "
            "topic's max.message.bytes (and the broker's), or make the event smaller"
        )
        self.topic = topic
        self.size = size
        self.error = error


class DeadLetterNotFound(NotFound):
    """No dead letter matches the given consumer and event id."""


class InvalidSequence(OutboxError):
    """An event's ``sequence`` (header ``ce_sequence``, or its envelope's) is not a
    non-negative 64-bit integer, so a handler guarded against stale events cannot order it
    (permanent: dead-lettered)."""

    retriable = False


class EnvelopeError(HandlerConfigurationError):
    """An envelope is declared wrongly (unknown name, bad JSON pointer, not an envelope), or
    a user's envelope broke its contract: it returned something other than
    :class:`inbox.envelopes.Opened`. The consumer stops (nothing is committed, the record is
    read again after a fix)."""


class Unreadable(OutboxError):
    """Raised by an envelope for a record it cannot read; the message is the reason the
    record is dead-lettered with (``malformed_policy``)."""

    retriable = False


class TombstoneRefused(OutboxError):
    """A tombstone (null value) reached a handler whose model parameter cannot be None
    (permanent: dead-lettered at once). Annotate it ``Model | None`` to receive deletions."""

    retriable = False


class ReplayRefused(OutboxError):
    """The event was already processed (e.g. replayed before); replaying again would
    apply it twice."""


class DuplicateInstanceId(ConfigurationError):
    """Two live consumer processes use the same group instance id
    (``OUTBOX_CONSUMER__GROUP_INSTANCE_ID``) in one group. Kafka lets only one of them be
    the member: it fences the other (``FENCED_INSTANCE_ID``), or each takes the member over
    from the other in turn. The process that joined last stops (exit code 2), naming the
    id; the one that had it keeps its partitions. Give every process its own id, e.g.
    ``{hostname}`` in a StatefulSet."""

    def __init__(self, instance_id: str, group: str, cause: str) -> None:
        super().__init__(
            f"another live consumer uses group instance id {instance_id!r} in group "
            f"{group!r} ({cause}); give every process its own "
            "OUTBOX_CONSUMER__GROUP_INSTANCE_ID (e.g. '{hostname}', or --instance-id)"
        )
        self.instance_id = instance_id
        self.group = group


class SessionTimeoutRefused(ConfigurationError):
    """The group session timeout static membership asks for
    (``OUTBOX_CONSUMER__STATIC_SESSION_TIMEOUT_MS``) is outside what the brokers allow
    (``group.min.session.timeout.ms`` .. ``group.max.session.timeout.ms``); checked at
    start, or refused by Kafka when the member joins (``INVALID_SESSION_TIMEOUT``)."""

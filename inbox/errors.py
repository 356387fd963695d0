"""Errors of the inbox consumer (all subclasses of :class:`outbox.errors.OutboxError`)."""

from __future__ import annotations

from outbox.errors import ConfigurationError, OutboxError


class HandlerConfigurationError(ConfigurationError):
    """A handler or consumer was declared wrongly (duplicate type, bad signature)."""


class ConsumerAppNotFound(ConfigurationError):
    """``outbox consume MODULE:ATTR`` could not import or find the consumer object."""


class DeadLetterNotFound(OutboxError):
    """No dead letter matches the given consumer and event id."""


class InvalidSequence(OutboxError):
    """An event's ``ce_sequence`` header is not a non-negative 64-bit integer, so a handler
    guarded against stale events cannot order it (permanent: dead-lettered)."""

    retriable = False


class TombstoneRefused(OutboxError):
    """A tombstone (null value) reached a handler whose model parameter cannot be None
    (permanent: dead-lettered at once). Annotate it ``Model | None`` to receive deletions."""

    retriable = False


class ReplayRefused(OutboxError):
    """The event was already processed (e.g. replayed before); replaying again would
    apply it twice."""

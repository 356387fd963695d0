"""Classifying handler failures and describing them without leaking the payload."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
import psycopg.errors
from aiokafka.errors import KafkaError
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from outbox.db import unavailable
from outbox.dberrors import is_transient
from outbox.errors import OutboxError
from outbox.resilience.classify import is_retryable


@dataclass(frozen=True)
class Failure:
    error_class: str
    message: str
    retryable: bool

    def text(self) -> str:
        return f"{self.error_class}: {self.message}"


_RETRYABLE_DB = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


def classify(exc: BaseException, max_chars: int) -> Failure:
    """Permanent or retryable, with a message cut to ``max_chars``.

    Validation errors are permanent: the same bytes fail the same way forever. Serialization
    failures and deadlocks are the database asking for a retry. Everything else follows
    :func:`outbox.resilience.classify.is_retryable` (the exception's own ``retriable`` flag first).
    """
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(exc, ValidationError):
        # str(ValidationError) echoes the offending input (payload); report locations only.
        message = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_input=False, include_url=False)
        )
        retryable = False
    else:
        message = str(exc) or type(exc).__name__
        retryable = isinstance(orig, _RETRYABLE_DB) or is_retryable(exc)
    return Failure(type(exc).__name__, _cut(message, max_chars), retryable)


def crashed(attempts: int, last: str | None, max_chars: int) -> Failure:
    """The failure recorded when attempts ran out without an exception being seen: the
    process died (or was killed) while running the handler."""
    message = f"{attempts} attempts did not finish (the process died or was killed during them)"
    if last:
        message += f"; last error: {last}"
    return Failure("ProcessCrashed", _cut(message, max_chars), False)


def malformed(reason: str, max_chars: int) -> Failure:
    """A record its envelope could not read (``reason`` is the envelope's)."""
    return Failure("MalformedRecord", _cut(reason, max_chars), False)


def unknown_type(event_type: str | None, topic: str) -> Failure:
    if event_type is None:
        return Failure("UnknownEventType", f"no handler for topic {topic!r} (no event type)", False)
    return Failure("UnknownEventType", f"no handler for event type {event_type!r}", False)


def is_infrastructure(exc: BaseException) -> bool:
    """Infrastructure trouble (database or broker unreachable) met while handling a run:
    the run is retried without charging its events an attempt."""
    # Database errors by the SQLSTATE table (outbox/dberrors.py): a read-only transaction or
    # a full disk met by the consumer's own statements is an outage, whatever the driver's
    # class; SQLAlchemy's errors, or psycopg's own from the hot path's statements
    # (inbox/store.py); a pool with every connection busy for its whole timeout.
    if is_transient(exc):
        return True
    if isinstance(exc, OutboxError):
        return exc.retriable
    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


def infrastructure_cause(exc: BaseException) -> str:
    """An outage's class and, for framework errors, its message (they never hold secrets)."""
    if isinstance(exc, OutboxError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, DBAPIError | psycopg.Error):
        return str(unavailable(exc))
    return type(exc).__name__


def _cut(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"

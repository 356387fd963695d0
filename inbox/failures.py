"""Classifying handler failures and describing them without leaking the payload or a
secret: the message (a validation error's locations, a database error's driver message
without its SQL and parameters, URLs blanked) and, formatted only now that the handler has
failed, the stack trace (inbox/traces.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import psycopg
import psycopg.errors
from aiokafka.errors import KafkaError
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from inbox import traces
from outbox.db import unavailable
from outbox.dberrors import is_transient
from outbox.errors import OutboxError
from outbox.resilience.classify import is_retryable
from outbox.scrub import scrub
from outbox.text import storable

# Characters of a formatted stack trace a dead letter keeps per attempt.
MAX_TRACE_CHARS = 6_000
# Set on a handler's exception (by the processor, on the failure path only): how long the
# handler ran before it raised.
_RAN_FOR = "_outbox_handler_seconds"


@dataclass(frozen=True)
class Failure:
    error_class: str
    message: str
    retryable: bool
    # Where and when (a handler's exception; None for failures no code raised).
    trace: str | None = field(default=None, compare=False)
    frame: str | None = field(default=None, compare=False)  # first application frame
    seconds: float | None = field(default=None, compare=False)
    at: float = field(default_factory=time.time, compare=False)

    def text(self) -> str:
        return f"{self.error_class}: {self.message}"


def ran_for(exc: BaseException, seconds: float) -> None:
    """Note on a handler's exception how long the handler ran (for :func:`classify`)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _RAN_FOR, seconds)


def message_of(exc: BaseException) -> str:
    """What an exception says, without what it must not repeat: a validation error's
    input (the payload), a database error's statement and parameters (SQLAlchemy appends
    both to the driver's message)."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_input=False, include_url=False)
        )
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return str(exc.orig) or type(exc.orig).__name__
    return str(exc) or type(exc).__name__


_RETRYABLE_DB = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


def classify(exc: BaseException, max_chars: int) -> Failure:
    """Permanent or retryable, with a message cut to ``max_chars`` (scrubbed), the stack
    trace and the first application frame (inbox/traces.py), and how long the handler ran.

    Validation errors are permanent: the same bytes fail the same way forever. Serialization
    failures and deadlocks are the database asking for a retry. Everything else follows
    :func:`outbox.resilience.classify.is_retryable` (the exception's own ``retriable`` flag first).
    """
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(exc, ValidationError):
        retryable = False
    else:
        retryable = isinstance(orig, _RETRYABLE_DB) or is_retryable(exc)
    seconds = getattr(exc, _RAN_FOR, None)
    return Failure(
        type(exc).__name__,
        _cut(scrub(message_of(exc)), max_chars),
        retryable,
        # Stored in the history (jsonb): escaped like the message.
        trace=storable(traces.format_trace(exc, MAX_TRACE_CHARS, message_of)),
        frame=traces.first_application_frame(exc),
        seconds=seconds if isinstance(seconds, float) else None,
    )


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
    # Kept in text columns and sent as UTF-8 headers: a NUL or lone surrogate (an error
    # echoing a record's bytes) is escaped, or recording the failure would fail too.
    text = storable(text.replace("\n", " "))
    return text if len(text) <= limit else text[: limit - 1] + "…"

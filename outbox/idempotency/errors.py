"""Errors of idempotent requests; each maps to an HTTP status and an error code (the ASGI
middleware answers with them)."""

from __future__ import annotations

from outbox.errors import OutboxError


class IdempotencyError(OutboxError):
    """Base of the idempotency errors; each maps to an HTTP status and an error code."""

    http_status = 400
    code = "idempotency.error"


class InvalidIdempotencyKey(IdempotencyError):
    """The key is missing, empty, longer than 255 characters or not printable text."""

    http_status = 400
    code = "idempotency.invalid_key"


class IdempotencyKeyRequired(InvalidIdempotencyKey):
    """The route requires an ``Idempotency-Key`` header and the request had none."""

    code = "idempotency.key_required"


class IdempotencyConflict(IdempotencyError):
    """The key was already used with a different request payload. Not retriable:
    the client must use a new key for a new request."""

    http_status = 422
    code = "idempotency.payload_mismatch"

    def __init__(self) -> None:
        super().__init__(
            "this Idempotency-Key was already used with a different request payload; "
            "use a new key for a new request"
        )


class IdempotencyInProgress(IdempotencyError):
    """A request with this key is still running; retry after ``retry_after`` seconds."""

    retriable = True
    http_status = 409
    code = "idempotency.in_progress"

    def __init__(self, retry_after: int = 1) -> None:
        super().__init__(
            "a request with this Idempotency-Key is still being processed; retry later"
        )
        self.retry_after = max(1, retry_after)


class IdempotencyLockLost(IdempotencyInProgress):
    """This request's claim was taken over (its lease ran out before the operation began);
    the operation was not run here."""

    code = "idempotency.lock_lost"

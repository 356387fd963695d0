"""Idempotent requests (the Stripe pattern): a stored response per ``Idempotency-Key``.

``keys`` holds the :class:`IdempotencyKeys` front (claim, run, replay), ``store`` its SQL,
``asgi`` the ASGI middleware that applies it to HTTP routes::

    from outbox.idempotency import IdempotencyKeys, scope_for
    from outbox.idempotency.asgi import IdempotencyMiddleware, idempotency_session
"""

from outbox.idempotency.errors import (
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyRequired,
    IdempotencyLockLost,
    InvalidIdempotencyKey,
)
from outbox.idempotency.keys import (
    IdempotencyKeys,
    Outcome,
    StoredResponse,
    request_hash,
    scope_for,
    strip_fields,
)

__all__ = [
    "IdempotencyConflict",
    "IdempotencyError",
    "IdempotencyInProgress",
    "IdempotencyKeyRequired",
    "IdempotencyKeys",
    "IdempotencyLockLost",
    "InvalidIdempotencyKey",
    "Outcome",
    "StoredResponse",
    "request_hash",
    "scope_for",
    "strip_fields",
]

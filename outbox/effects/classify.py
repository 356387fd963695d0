"""Three failure classes for a call with an external effect: retryable, permanent, ambiguous.

* **retryable** — provably without effect: the request was never sent or the server said it
  did not process it (connection refused, DNS failure, connect timeout, 408, 425, 429, 503;
  a database that answered with an outage or a conflict of the SQLSTATE table, such as a
  full disk or a deadlock: its transaction did not commit).
  Retried with the same key under the retry policy, budget and breaker.
* **permanent** — will fail the same way every time: 4xx validation and auth answers
  (400, 401, 403, 404, 409, 422, ...) and programming errors (``ValueError``,
  ``TypeError``, ``LookupError``). Stored and replayed, never retried.
* **ambiguous** — the request may have been applied: a read timeout, a reset or a closed
  connection after sending, 500, 502, 504 and any other 5xx, and any exception this module
  does not recognise (guessing "retryable" there is how a duplicate is made). Never retried
  blindly: reconciled by key first.

User code can declare the class: raise :class:`outbox.resilience.Permanent`,
:class:`outbox.resilience.Retryable` or :class:`Ambiguous`, or pass ``classify=`` to
:meth:`outbox.effects.Effects.run` (a callable returning an :class:`EffectClass`, or None
to fall back to :func:`classify`).
"""

from __future__ import annotations

import enum
import errno
import json
import socket
from collections.abc import Callable

import psycopg
from sqlalchemy.exc import DBAPIError

from outbox.dberrors import DbTrouble, trouble
from outbox.errors import OutboxError
from outbox.resilience.classify import status_of


class EffectClass(enum.StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    AMBIGUOUS = "ambiguous"


class Ambiguous(OutboxError):
    """Raise (or subclass) to declare that an attempt may have taken effect."""

    retriable = True


Classifier = Callable[[BaseException], EffectClass | None]

# The server answered without processing: throttled, overloaded, or it never got the
# whole request. 502/504 are not here: a gateway may have forwarded the request upstream.
_NOT_PROCESSED_STATUSES = frozenset({408, 425, 429, 503})
_NOT_SENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}
)
# Client libraries' "the connection was never made" errors, by class name so that httpx,
# requests and aiohttp classify without being imported: their read-side errors (ReadTimeout,
# RemoteProtocolError, ServerDisconnectedError, ...) fall through to ambiguous.
_NOT_SENT_NAMES = frozenset(
    {
        "ConnectError",
        "ConnectTimeout",
        "PoolTimeout",
        "ClientConnectorError",
        "ClientConnectorDNSError",
        "NameResolutionError",
    }
)


def classify_status(status: int) -> EffectClass:
    """HTTP status -> class (only for failed exchanges: 4xx and 5xx)."""
    if status in _NOT_PROCESSED_STATUSES:
        return EffectClass.RETRYABLE
    if 500 <= status <= 599:
        return EffectClass.AMBIGUOUS
    return EffectClass.PERMANENT


def _declared(exc: BaseException) -> EffectClass | None:
    if isinstance(exc, Ambiguous):
        return EffectClass.AMBIGUOUS
    if isinstance(exc, OutboxError):
        # Permanent / Retryable and framework errors say it with their flag.
        return EffectClass.RETRYABLE if exc.retriable else EffectClass.PERMANENT
    return None


def _not_sent(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionRefusedError | socket.gaierror):
        return True
    if (
        isinstance(exc, OSError)
        and not isinstance(exc, TimeoutError)
        and exc.errno in _NOT_SENT_ERRNOS
    ):
        return True
    return any(cls.__name__ in _NOT_SENT_NAMES for cls in type(exc).__mro__)


def _database_refused_work(exc: BaseException) -> bool:
    """A database answered with an outage or a conflict of the SQLSTATE table
    (``outbox/dberrors.py``: a full disk, a read-only switch, a shutdown, a deadlock): the
    statement failed and its transaction did not commit, so nothing was applied. A
    connection lost with no answer (no SQLSTATE) may have carried a COMMIT, and stays
    ambiguous."""
    orig = getattr(exc, "orig", None) if isinstance(exc, DBAPIError) else exc
    if not isinstance(orig, psycopg.Error) or not orig.sqlstate:
        return False
    return trouble(exc) in (DbTrouble.OUTAGE, DbTrouble.CONFLICT)


def classify(exc: BaseException) -> EffectClass:
    """The default classification (see the module docstring for the rules)."""
    declared = _declared(exc)
    if declared is not None:
        return declared
    if _database_refused_work(exc):
        return EffectClass.RETRYABLE
    status = status_of(exc)
    if status is not None and status >= 400:
        return classify_status(status)
    if _not_sent(exc):
        return EffectClass.RETRYABLE
    # urllib wraps the socket error of a failed connection in URLError.reason.
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException) and _not_sent(reason):
        return EffectClass.RETRYABLE
    # A bad argument fails before anything is sent; a response that cannot be decoded
    # (UnicodeError, a JSON error) came back from a request that may have been applied.
    if isinstance(exc, ValueError | TypeError | LookupError) and not isinstance(
        exc, UnicodeError | json.JSONDecodeError
    ):
        return EffectClass.PERMANENT
    return EffectClass.AMBIGUOUS


def classifier(custom: Classifier | None) -> Callable[[BaseException], EffectClass]:
    """``custom`` first (None from it means "no opinion"), then :func:`classify`."""
    if custom is None:
        return classify

    def combined(exc: BaseException) -> EffectClass:
        return custom(exc) or classify(exc)

    return combined

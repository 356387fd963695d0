"""Idempotent requests (the Stripe pattern), atomic with the caller's domain rows and outbox.

A client sends an unsafe request with an ``Idempotency-Key``. The first request with a key
runs the operation; every later request with the same key (within ``ttl``) gets the stored
response back, byte for byte, without running it again::

    keys = IdempotencyKeys(settings)
    outcome = keys.run(
        engine,
        scope=scope_for(tenant_id, "POST /refunds"),
        key=request.headers["Idempotency-Key"],
        payload=body,
        operation=lambda session: create_refund(session, body),  # -> StoredResponse
    )

Transaction design
------------------
The record has to do two things that pull in opposite directions: concurrent requests
must *see* the claim while the operation runs (to answer "in progress" instead of running
it twice), yet the response must commit *atomically* with the operation's effects (so a
crash can never leave "complete" without the refund, or the refund without "complete").
One transaction cannot do both — an uncommitted claim is invisible — so there are two:

1. **Claim** (short, committed at once): ``INSERT ... ON CONFLICT DO NOTHING`` creates a
   ``pending`` record with a random ``lock_token`` and a lease ``locked_until``. The unique
   key makes the claim atomic: there is no check-then-insert window.
2. **Operation** (the caller's unit of work): ``SELECT ... FOR UPDATE`` re-locks the record
   *if its token is still ours*, then the operation runs in a savepoint with the same
   session, then the response is written to the record; domain rows, ``outbox.publish``
   rows and the response commit together or not at all.

A live owner holds that row lock until it commits, and takeovers use ``FOR UPDATE SKIP
LOCKED``, so a slow owner past its lease is never run twice. A crashed owner's lock dies
with its connection and its effects roll back; once the lease has passed, the next request
with the key takes the record over (new token) and runs the operation — the effect happens
once. If the old owner was merely paused between the two steps, it finds its token gone
and stops with :class:`IdempotencyLockLost` before touching anything.

Outcomes: a final response (a returned 2xx-4xx other than 408/425/429, or a permanent
exception turned into a response) is stored and replayed — a stored failure too. A
transient failure (a retryable exception, or a returned 408/425/429/5xx) rolls the effects
back and deletes the record, so a retry with the same key runs again. A non-``Exception``
exit (cancellation) leaves the record to its lease, like a crash.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, Result
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

from outbox import tracing
from outbox.canonical import canonical_json, sha256_hex
from outbox.db import translated_errors
from outbox.dberrors import DbTrouble, trouble
from outbox.errors import OutboxError
from outbox.idempotency.errors import (
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyRequired,
    IdempotencyLockLost,
    InvalidIdempotencyKey,
)
from outbox.idempotency.metrics import Recorder, metrics_for
from outbox.idempotency.store import COMPLETE, FAILED, IdempotencyStore
from outbox.resilience.classify import is_retryable, is_retryable_status, status_of
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

log = logging.getLogger("outbox.idempotency")

MAX_KEY_LENGTH = 255
# Span attributes set on the current span (the request's, when the app traces requests).
REPLAYED = "outbox.idempotency.replayed"
STORED = "outbox.idempotency.stored"
TAKEOVER = "outbox.idempotency.takeover"
# A claim that keeps vanishing under us (released or purged between two statements)
# is retried a few times, then reported as in progress.
_CLAIM_ROUNDS = 3


def _trace(key: str, outcome: Outcome) -> None:
    tracing.set_current_attributes(
        {tracing.IDEMPOTENCY_KEY: key, REPLAYED: outcome.replayed, STORED: outcome.stored}
    )


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class StoredResponse:
    """A response as stored and replayed: status, exact body bytes, headers in order."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(
        cls, status: int, value: Any, headers: Iterable[tuple[str, str]] = ()
    ) -> StoredResponse:
        """A JSON response (canonical encoding, so equal values give equal bytes)."""
        return cls(status, canonical_json(value), (("content-type", "application/json"), *headers))

    @property
    def final(self) -> bool:
        """Whether the response is kept and replayed (a retryable status is not)."""
        return not is_retryable_status(self.status)


@dataclass(frozen=True)
class Outcome:
    """What a request with a key got.

    ``replayed``: an earlier request's stored response; the operation did not run now.
    ``stored``: the response was recorded for replays (False after a transient failure).
    """

    response: StoredResponse
    replayed: bool
    stored: bool


@dataclass(frozen=True)
class _Request:
    scope: str
    key: str
    payload_hash: str
    ttl: timedelta
    lock_timeout: timedelta


@dataclass(frozen=True)
class _Claim:
    request: _Request
    token: uuid.UUID

    @property
    def params(self) -> dict[str, Any]:
        return IdempotencyStore.owner_params(self.request.scope, self.request.key, self.token)


# -------------------------------------------------------------------------- helpers


def validate_key(key: str | None) -> str:
    """Return ``key`` if it is a usable idempotency key (1-255 printable characters)."""
    if key is None:
        raise IdempotencyKeyRequired("an Idempotency-Key is required for this request")
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(
            f"an Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters, got {len(key)}"
        )
    if not key.isprintable():
        raise InvalidIdempotencyKey("an Idempotency-Key must be printable text")
    return key


def scope_for(principal: str, route: str) -> str:
    """The scope of a key: who sent it and to which route, so keys never collide across
    users or operations. Encoded unambiguously (``"a|b", "c"`` differs from ``"a", "b|c"``).
    """
    return canonical_json([principal, route]).decode()


def strip_fields(payload: Any, fields: Iterable[str]) -> Any:
    """A copy of ``payload`` without volatile fields (dotted paths into nested objects).

    >>> strip_fields({"amount": 10, "meta": {"sent_at": "...", "ip": "x"}}, ["meta.sent_at"])
    {'amount': 10, 'meta': {'ip': 'x'}}
    """
    paths = [f.split(".") for f in fields]

    def strip(value: Any, prefix: tuple[str, ...]) -> Any:
        if not isinstance(value, dict):
            return value
        out = {}
        for name, item in value.items():
            here = (*prefix, str(name))
            if list(here) in paths:
                continue
            out[name] = strip(item, here)
        return out

    return strip(payload, ())


def request_hash(payload: Any, ignore: Iterable[str] = ()) -> str:
    """SHA-256 (hex) of the canonical JSON of ``payload`` minus the ``ignore`` fields.

    Strip what a client regenerates on every retry (timestamps, trace ids) and keep what
    distinguishes operations (ids, amounts, destinations), or retries look like conflicts.
    """
    return sha256_hex(strip_fields(payload, ignore))


def failure_response(exc: Exception) -> StoredResponse:
    """Default stored response of a permanent exception: its HTTP status (else 500) and a
    JSON error. Only framework errors and declared HTTP errors show their message; other
    exceptions may carry internals, so they get a generic one."""
    status = status_of(exc) or 500
    detail = getattr(exc, "detail", None)
    message = (
        detail
        if isinstance(detail, str)
        else str(exc)
        if isinstance(exc, OutboxError)
        else "the request failed and will not succeed if repeated"
    )
    code = getattr(exc, "code", None)
    return StoredResponse.json(
        status, {"error": {"code": code if isinstance(code, str) else "failed", "message": message}}
    )


# ----------------------------------------------------------------------------- front

_Step = tuple[Executable, dict[str, Any]]
_TAKEOVER: Literal["takeover"] = "takeover"


class IdempotencyKeys:
    """Runs operations once per (scope, key); sync (:meth:`run`) and async (:meth:`run_async`).

    ``failure_response`` turns a permanent exception into the response that is stored and
    replayed (default: :func:`failure_response`). Requests are counted by outcome in
    ``outbox_idempotency_requests_total`` on ``registry`` (default: prometheus-client's).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        failure_response: Callable[[Exception], StoredResponse] = failure_response,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.tables = build_tables(settings)
        self._store = IdempotencyStore(self.tables)
        self._failure_response = failure_response
        self._metrics = metrics_for(registry)

    # -- pure parts shared by sync and async ----------------------------------------------
    def _request(
        self,
        scope: str,
        key: str,
        payload: Any,
        payload_hash: str | None,
        ttl: timedelta | None,
        lock_timeout: timedelta | None,
    ) -> _Request:
        validate_key(key)
        if payload_hash is None:
            payload_hash = request_hash(payload)
        cfg = self.settings.idempotency
        return _Request(
            scope=scope,
            key=key,
            payload_hash=payload_hash,
            ttl=ttl or timedelta(hours=cfg.ttl_hours),
            lock_timeout=lock_timeout or timedelta(seconds=cfg.lock_timeout_seconds),
        )

    @staticmethod
    def _decide(row: Any, request: _Request, may_take_over: bool) -> Outcome | Literal["takeover"]:
        if row.expired:
            # An expired record is forgotten: the key starts afresh, whatever the payload.
            if may_take_over:
                return _TAKEOVER
            raise IdempotencyInProgress(row.lease_left or 1)
        if row.payload_hash != request.payload_hash:
            raise IdempotencyConflict()
        if row.status in (COMPLETE, FAILED):
            headers = tuple((str(n), str(v)) for n, v in row.response_headers or ())
            response = StoredResponse(row.response_status, bytes(row.response_body or b""), headers)
            return Outcome(response, replayed=True, stored=True)
        if row.lease_live or not may_take_over:
            raise IdempotencyInProgress(row.lease_left or 1)
        return _TAKEOVER

    def _claim_steps(self, request: _Request) -> Generator[_Step, Result[Any], _Claim | Outcome]:
        """The claim protocol as a generator of statements (driven by sync or async code)."""
        where = self._store.record_params(request.scope, request.key)
        for _ in range(_CLAIM_ROUNDS):
            token = uuid.uuid4()
            claim = self._store.claim_params(
                request.scope,
                request.key,
                request.payload_hash,
                request.ttl,
                request.lock_timeout,
                token,
            )
            if (yield self._store.insert_claim, claim).first() is not None:
                return _Claim(request, token)
            row = (yield self._store.read, where).first()
            if row is None:
                continue  # released or purged since our insert: claim again
            if self._decide(row, request, may_take_over=True) == _TAKEOVER:
                if (yield self._store.takeover, claim).first() is not None:
                    log.info("idempotency key taken over (expired or owner lease ran out)")
                    # This run retries one whose owner died or expired.
                    tracing.set_current_attributes({TAKEOVER: True})
                    return _Claim(request, token)
                row = (yield self._store.read, where).first()
                if row is None:
                    continue
            decision = self._decide(row, request, may_take_over=False)
            assert isinstance(decision, Outcome)  # may_take_over=False never says takeover
            return decision
        raise IdempotencyInProgress()

    def failure_for(self, exc: Exception) -> StoredResponse | None:
        """The response stored for an operation that raised ``exc``, or None when the
        failure is transient (the key is released). The exception decides, by
        :func:`outbox.resilience.classify.is_retryable`; a permanent one is stored whatever
        its status. A database outage or conflict (the SQLSTATE table,
        ``outbox/dberrors.py``) is always transient: a full disk is never the request's
        fault, and is never stored as its answer."""
        if trouble(exc) in (DbTrouble.OUTAGE, DbTrouble.CONFLICT) or is_retryable(exc):
            return None
        return self._failure_response(exc)

    def _settle_step(self, claim: _Claim, response: StoredResponse | None) -> _Step:
        if response is None:
            return self._store.release, claim.params
        return self._store.finish, self._store.finish_params(
            claim.params, response.status, response.headers, response.body
        )

    # -- sync -----------------------------------------------------------------------------
    def run(
        self,
        engine: Engine,
        *,
        scope: str,
        key: str,
        operation: Callable[[Session], StoredResponse],
        payload: Any = None,
        payload_hash: str | None = None,
        ttl: timedelta | None = None,
        lock_timeout: timedelta | None = None,
        session_factory: Callable[[], Session] | None = None,
    ) -> Outcome:
        """Run ``operation(session)`` once for (scope, key), or replay its stored response.

        The session's transaction holds the idempotency record: add domain rows and call
        ``Outbox.publish(session, ...)`` in it, and do not commit — the response is stored
        and everything commits together when the operation returns.

        Raises :class:`IdempotencyConflict`, :class:`IdempotencyInProgress`,
        :class:`InvalidIdempotencyKey`, or the operation's own exception (after storing
        it as a failure if permanent, or releasing the key if transient).
        """
        with self._metrics.request() as record:
            request = self._request(scope, key, payload, payload_hash, ttl, lock_timeout)
            with translated_errors(), engine.begin() as conn:
                steps = self._claim_steps(request)
                try:
                    statement = next(steps)
                    while True:
                        statement = steps.send(conn.execute(*statement))
                except StopIteration as done:
                    claimed: _Claim | Outcome = done.value
            if isinstance(claimed, Outcome):
                outcome = claimed
            else:
                factory = session_factory or (lambda: Session(engine, expire_on_commit=False))
                with factory() as session:
                    outcome = self._operate(session, claimed, operation, record)
            record.outcome(outcome)
            _trace(key, outcome)
            return outcome

    def _operate(
        self,
        session: Session,
        claim: _Claim,
        operation: Callable[[Session], StoredResponse],
        record: Recorder,
    ) -> Outcome:
        with translated_errors():
            if session.execute(self._store.lock_owned, claim.params).first() is None:
                session.rollback()
                raise IdempotencyLockLost()
        savepoint = session.begin_nested()
        try:
            response = operation(session)
        except Exception as exc:
            savepoint.rollback()
            failure = self.failure_for(exc)
            self._settle(session, claim, failure)
            record.count("released" if failure is None else "failed")
            raise
        if response.final:
            savepoint.commit()
        else:
            savepoint.rollback()
        self._settle(session, claim, response if response.final else None)
        return Outcome(response, replayed=False, stored=response.final)

    def _settle(self, session: Session, claim: _Claim, response: StoredResponse | None) -> None:
        try:
            with translated_errors():
                session.execute(*self._settle_step(claim, response))
                session.commit()
        except Exception:
            session.rollback()
            # Best effort, so the key does not answer "in progress" until the lease ends.
            # If the commit did land, the token is gone and this deletes nothing.
            with contextlib.suppress(Exception):
                session.execute(self._store.release, claim.params)
                session.commit()
            raise

    def purge_expired(
        self, engine: Engine, *, batch_size: int | None = None, max_batches: int | None = None
    ) -> int:
        """Delete expired records in batches of ``batch_size``, one transaction per batch
        (no long-held locks, no giant DELETE). Returns how many rows were deleted."""
        limit = batch_size or self.settings.idempotency.purge_batch_size
        total = batches = 0
        while max_batches is None or batches < max_batches:
            with translated_errors(), engine.begin() as conn:
                deleted = conn.execute(
                    self._store.purge_batch, self._store.purge_params(limit)
                ).rowcount
            total += deleted
            batches += 1
            if deleted < limit:
                break
        return total

    # -- async ----------------------------------------------------------------------------
    async def run_async(
        self,
        engine: AsyncEngine,
        *,
        scope: str,
        key: str,
        operation: Callable[[AsyncSession], Awaitable[StoredResponse]],
        payload: Any = None,
        payload_hash: str | None = None,
        ttl: timedelta | None = None,
        lock_timeout: timedelta | None = None,
        session_factory: Callable[[], AsyncSession] | None = None,
    ) -> Outcome:
        """Async :meth:`run` (``operation`` is awaited with an ``AsyncSession``)."""
        with self._metrics.request() as record:
            request = self._request(scope, key, payload, payload_hash, ttl, lock_timeout)
            with translated_errors():
                async with engine.begin() as conn:
                    steps = self._claim_steps(request)
                    try:
                        statement = next(steps)
                        while True:
                            statement = steps.send(await conn.execute(*statement))
                    except StopIteration as done:
                        claimed: _Claim | Outcome = done.value
            if isinstance(claimed, Outcome):
                outcome = claimed
            else:
                factory = session_factory or (lambda: AsyncSession(engine, expire_on_commit=False))
                async with factory() as session:
                    outcome = await self._operate_async(session, claimed, operation, record)
            record.outcome(outcome)
            _trace(key, outcome)
            return outcome

    async def _operate_async(
        self,
        session: AsyncSession,
        claim: _Claim,
        operation: Callable[[AsyncSession], Awaitable[StoredResponse]],
        record: Recorder,
    ) -> Outcome:
        with translated_errors():
            if (await session.execute(self._store.lock_owned, claim.params)).first() is None:
                await session.rollback()
                raise IdempotencyLockLost()
        savepoint = await session.begin_nested()
        try:
            response = await operation(session)
        except Exception as exc:
            await savepoint.rollback()
            failure = self.failure_for(exc)
            await self._settle_async(session, claim, failure)
            record.count("released" if failure is None else "failed")
            raise
        if response.final:
            await savepoint.commit()
        else:
            await savepoint.rollback()
        await self._settle_async(session, claim, response if response.final else None)
        return Outcome(response, replayed=False, stored=response.final)

    async def _settle_async(
        self, session: AsyncSession, claim: _Claim, response: StoredResponse | None
    ) -> None:
        try:
            with translated_errors():
                await session.execute(*self._settle_step(claim, response))
                await session.commit()
        except Exception:
            await session.rollback()
            with contextlib.suppress(Exception):
                await session.execute(self._store.release, claim.params)
                await session.commit()
            raise

    async def purge_expired_async(
        self, engine: AsyncEngine, *, batch_size: int | None = None, max_batches: int | None = None
    ) -> int:
        """Async :meth:`purge_expired`."""
        limit = batch_size or self.settings.idempotency.purge_batch_size
        total = batches = 0
        while max_batches is None or batches < max_batches:
            with translated_errors():
                async with engine.begin() as conn:
                    deleted = (
                        await conn.execute(self._store.purge_batch, self._store.purge_params(limit))
                    ).rowcount
            total += deleted
            batches += 1
            if deleted < limit:
                break
        return total

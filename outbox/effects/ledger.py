"""The side-effect ledger: an external effect (a refund, an e-mail, a partner call) happens at
most once per key, and its outcome is replayed to every later caller with the key::

    effects = Effects(settings)
    result = await effects.run_async(
        engine,
        key=idempotency_key("refund", run_id, step, payload=args),  # from intent
        payload=args,
        call=lambda key: provider.refund(charge, amount, idempotency_key=key),
        reconcile=lambda key: provider.find_refund(key),  # -> its result, or NOT_APPLIED
        window=timedelta(days=30),
    )

States of a key's record: ``pending`` (claimed and committed before the call, with a
lease), ``done`` (result stored, replayed), ``failed`` (permanent failure stored, replayed),
``unknown`` (an attempt may have been applied and nothing could tell: parked for an
operator). docs/concepts/ambiguous-outcomes.md draws the states.

Locking — why exactly one caller calls
--------------------------------------
1. **Claim** (its own short transaction, committed *before* any call): ``INSERT ... ON
   CONFLICT DO NOTHING``. The primary key makes the claim atomic — no check-then-insert
   window — and only the one inserting caller gets its token back. Committing first is the
   point: a claim that is not committed is invisible to other callers and vanishes if this
   process dies after the call, which is exactly when it is needed.
2. **Call** (a second transaction, held open while the call runs): the owner locks its row
   ``FOR UPDATE`` if its token still owns it, calls, writes the outcome and commits. The
   row lock is the liveness signal: every other caller reads the row ``FOR UPDATE SKIP
   LOCKED``, so a row held by a running owner — however slow, lease or not — answers "in
   progress" and is never reconciled or called concurrently. If the owner's process dies,
   PostgreSQL drops its connection and the lock with it; the row stays ``pending``.
3. **Recovery**: once a dead owner's lease has run out (the lease only covers the gap
   between steps 1 and 2, and how long to wait before presuming a crash), the next caller
   takes the row over under its row lock (new token) and asks ``reconcile(key)`` before
   anything else: applied -> ``done`` with that result; ``NOT_APPLIED`` -> call. Without a
   ``reconcile`` the row becomes ``unknown`` and :class:`EffectOutcomeUnknown` is raised;
   nobody calls the key again until an operator resolves it (``outbox effects resolve``).

The protocol is written once, as a generator of steps (:meth:`Effects._steps`); ``run`` and
``run_async`` only drive it with a sync or an async connection.

Retries (inside step 2, same key every time): retryable failures (nothing was applied) are
retried under the ``RetryPolicy`` (full jitter, ``Retry-After``) and the ``RetryBudget``;
an ambiguous one is reconciled after the backoff and called again only if not applied; a
permanent one is stored. One ``CircuitBreaker`` per ``dependency``: an open circuit is a
state signal — the call is not made, the claim is released, :class:`CircuitOpen` is raised
and never retried here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import tracing
from outbox.canonical import idempotency_key, sha256_hex
from outbox.db import translated_errors
from outbox.dberrors import is_outage
from outbox.effects.classify import Classifier, EffectClass, classifier
from outbox.effects.errors import (
    EffectConflict,
    EffectFailed,
    EffectInProgress,
    EffectLeaseLost,
    EffectOutcomeUnknown,
)
from outbox.effects.metrics import effect_metrics
from outbox.effects.records import MESSAGE_LIMIT, EffectOperations, jsonable
from outbox.effects.steps import (
    CALL,
    COMMIT,
    RECONCILE,
    Call,
    Commit,
    Feeder,
    Finished,
    Reconcile,
    Sleep,
    Sql,
    Steps,
)
from outbox.effects.store import DONE, FAILED, PENDING, EffectStore
from outbox.resilience.breaker import CircuitBreaker, CircuitBreakers, CircuitOpen
from outbox.resilience.budget import RetryBudget, RetryBudgetExhausted
from outbox.resilience.classify import status_of
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

log = logging.getLogger("outbox.effects")

MAX_KEY_LENGTH = 255
# A claim that keeps vanishing under us (released or purged between two statements) is
# retried a few times, then reported as in progress.
_CLAIM_ROUNDS = 3
# The ledger's own connection runs in transactions whatever the engine's default: under
# AUTOCOMMIT the row lock that keeps a second caller off the key during the call would end
# with its statement.
_ISOLATION = "READ COMMITTED"


class _NotApplied:
    """The answer of a ``reconcile`` that found no trace of the effect."""

    def __repr__(self) -> str:
        return "NOT_APPLIED"


NOT_APPLIED: Any = _NotApplied()


class HasEventId(Protocol):
    @property
    def event_id(self) -> str: ...


def effect_key(event_id: str, step: str) -> str:
    """The key of one external effect of one event: a redelivered or replayed event gets
    the same key, so its effect is replayed from the ledger, not repeated. ``step`` names
    the effect within the handler (``"refund"``, ``"email-receipt"``)."""
    return str(idempotency_key("effect", event_id, step))


def key_for(event: HasEventId, step: str) -> str:
    """``effect_key(event.event_id, step)`` for an :class:`inbox.event.InboxEvent` (or any
    object with an ``event_id``)."""
    return effect_key(event.event_id, step)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception, bounded (stored as ``last_error``)."""
    text = _first_line(exc)
    return f"{type(exc).__name__}: {text}"[:MESSAGE_LIMIT] if text else type(exc).__name__


def error_record(exc: BaseException) -> dict[str, Any]:
    """What a permanent failure stores and replays: type, first message line, HTTP status."""
    text = _first_line(exc)
    return {"type": type(exc).__name__, "message": text[:MESSAGE_LIMIT], "status": status_of(exc)}


@dataclass(frozen=True)
class _Effect:
    key: str
    payload_hash: str
    dependency: str
    window: timedelta
    lease: timedelta
    classify: Callable[[BaseException], EffectClass]
    reconcilable: bool


class Effects(EffectOperations):
    """Runs external effects at most once per key; sync (:meth:`run`), async (:meth:`run_async`).

    ``policy`` defaults to the retry settings, ``budget`` to a default ``RetryBudget``;
    one circuit breaker per ``dependency`` name is kept here, made by ``breaker(name)``
    (default ``CircuitBreaker(name)``) — share one ``Effects`` per process. ``lease``: how
    long a dead caller's claim blocks the key before the next caller reconciles (default
    30 s). ``window``: default dedupe window when a call gives none (1 day). Metrics go to
    ``registry`` (default: prometheus-client's).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        breaker: Callable[[str], CircuitBreaker] | None = None,
        lease: timedelta = timedelta(seconds=30),
        window: timedelta = timedelta(days=1),
        registry: CollectorRegistry | None = None,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self._store = EffectStore(build_tables(settings))
        self.policy = policy or RetryPolicy.from_settings(settings.retry)
        self.budget = budget or RetryBudget()
        self.metrics = effect_metrics(registry)
        self._breakers = CircuitBreakers(factory=breaker or CircuitBreaker)
        self.lease = lease
        self.window = window
        self._sleep = sleep
        self._async_sleep = async_sleep

    def breaker(self, dependency: str) -> CircuitBreaker:
        """The circuit breaker of ``dependency`` (made on first use by the ``breaker``
        factory given, default ``CircuitBreaker(dependency)``)."""
        return self._breakers.get(dependency)

    # -- pure parts --------------------------------------------------------------------
    def _effect(
        self,
        key: str | uuid.UUID,
        payload: Any,
        dependency: str,
        window: timedelta | None,
        lease: timedelta | None,
        classify: Classifier | None,
        reconcilable: bool,
    ) -> _Effect:
        text = str(key)
        if not 1 <= len(text) <= MAX_KEY_LENGTH or not text.isprintable():
            raise ValueError(f"an effect key must be 1 to {MAX_KEY_LENGTH} printable characters")
        window = window or self.window
        lease = lease or self.lease
        if window <= timedelta(0) or lease <= timedelta(0):
            raise ValueError("window and lease must be positive")
        return _Effect(
            key=text,
            payload_hash=sha256_hex(payload),
            dependency=dependency,
            window=window,
            lease=lease,
            classify=classifier(classify),
            reconcilable=reconcilable,
        )

    # -- the protocol ----------------------------------------------------------------------
    def _steps(self, e: _Effect) -> Steps:
        """Claim (or replay, or refuse), then call under the row lock. Returns the result."""
        store, key = self._store, e.key
        token = uuid.uuid4()
        claim = store.claim_params(key, e.payload_hash, e.dependency, e.window, e.lease, token)
        where = store.key_params(key)
        reconcile_first = False
        tracing.set_current_attributes(
            {tracing.EFFECT_KEY: key, tracing.EFFECT_DEPENDENCY: e.dependency}
        )
        for _ in range(_CLAIM_ROUNDS):
            if (yield Sql(store.insert_claim, claim)).first() is not None:
                break
            row = (yield Sql(store.read_unlocked_only, where)).first()
            if row is None:
                if (yield Sql(store.exists, where)).first() is not None:
                    # Locked: its owner is calling right now (or another caller is deciding).
                    self.metrics.in_progress.inc()
                    raise EffectInProgress(key)
                continue  # released or purged since our insert: claim again
            if row.state in (DONE, FAILED) and row.expired:
                # Past its dedupe window the record is forgotten: the key runs afresh.
                yield Sql(store.takeover, claim)
                break
            if row.payload_hash != e.payload_hash:
                self.metrics.conflicts.inc()
                raise EffectConflict(key)
            if row.state in (DONE, FAILED):
                tracing.set_current_attributes({tracing.EFFECT_REPLAYED: row.state})
            if row.state == DONE:
                self.metrics.replays.labels(DONE).inc()
                return row.result
            if row.state == FAILED:
                self.metrics.replays.labels(FAILED).inc()
                raise EffectFailed(key, row.error or {}, replayed=True)
            if row.state == PENDING and row.lease_live:
                self.metrics.in_progress.inc()
                raise EffectInProgress(key, row.lease_left)
            # A dead caller's claim (pending past its lease) or an unknown outcome: the
            # effect may have happened. Ask the dependency before anything else.
            if not e.reconcilable:
                if row.state == PENDING:
                    detail = "its caller died during the call and no reconcile was given"
                    yield Sql(store.mark_unknown, store.error_params(key, detail))
                    yield COMMIT
                    self.metrics.unknown.inc()
                else:
                    detail = "an earlier attempt was ambiguous and no reconcile was given"
                raise EffectOutcomeUnknown(key, detail)
            yield Sql(store.takeover, claim)
            reconcile_first = True
            break
        else:
            self.metrics.in_progress.inc()
            raise EffectInProgress(key)
        yield COMMIT
        return (yield from self._owned(e, token, reconcile_first))

    def _owned(self, e: _Effect, token: uuid.UUID, reconcile_first: bool) -> Steps:
        store, key = self._store, e.key
        owner = store.owner_params(key, token)
        if (yield Sql(store.lock_owned, owner)).first() is None:
            raise EffectLeaseLost(key)  # taken over between claim and lock: nothing called
        # From here until the last commit this connection holds the row lock.
        if reconcile_first:
            answer = yield from self._reconciled(e)
            if answer is not NOT_APPLIED:
                return (yield from self._done(e, answer, called=False))
        breaker = self.breaker(e.dependency)
        started = time.monotonic()
        self.budget.record_request()
        attempts = 0
        while True:
            attempts += 1
            if attempts > 1 and (yield Sql(store.lock_owned, owner)).first() is None:
                # Still ours? While this transaction lives, its lock keeps the row; if the
                # connection died during the wait (idle-in-transaction timeout, network,
                # failover), the statement fails and nothing is called: a later caller
                # reconciles. Never call on a lock that may be gone.
                raise EffectLeaseLost(key)
            tracing.set_current_attributes({tracing.ATTEMPT: attempts})
            try:
                try:
                    with breaker.guard():
                        value = yield CALL
                finally:
                    self.metrics.breaker_is(e.dependency, breaker.state)
            except CircuitOpen:
                # Not called: the claim goes, the caller sees the state signal.
                yield from self._release(e)
                raise
            except Exception as exc:
                kind, detail = e.classify(exc), describe(exc)
                self.metrics.calls.labels(e.dependency, kind.value).inc()
                log.info("effect %s attempt %d: %s (%s)", key, attempts, detail, kind)
                if kind is EffectClass.PERMANENT:
                    error = error_record(exc)
                    yield Sql(store.finish_failed, store.outcome_params(key, error, True))
                    yield COMMIT
                    raise EffectFailed(key, error, replayed=False) from exc
                if kind is EffectClass.AMBIGUOUS and not e.reconcilable:
                    yield Sql(store.mark_unknown, store.error_params(key, detail))
                    yield COMMIT
                    self.metrics.unknown.inc()
                    raise EffectOutcomeUnknown(key, detail) from exc
                yield Sql(store.attempt_failed, store.error_params(key, detail))
                # The wait holds the row lock and an idle transaction: never past the lease.
                delay = self.policy.delay_for(
                    attempts, exc, time.monotonic() - started, limit=e.lease.total_seconds()
                )
                if kind is EffectClass.AMBIGUOUS:
                    # Give an in-flight request time to land, then ask before calling again.
                    yield Sleep(delay if delay is not None else self.policy.base_seconds)
                    answer = yield from self._reconciled(e)
                    if answer is not NOT_APPLIED:  # the attempt is counted already
                        return (yield from self._done(e, answer, called=False))
                if delay is None:
                    yield from self._release(e)  # retryable or reconciled: nothing applied
                    raise exc
                if not self.budget.try_spend():
                    yield from self._release(e)
                    raise RetryBudgetExhausted(attempts) from exc
                if kind is EffectClass.RETRYABLE:
                    yield Sleep(delay)
                continue
            self.metrics.calls.labels(e.dependency, "ok").inc()
            return (yield from self._done(e, value, called=True))

    def _reconciled(self, e: _Effect) -> Steps:
        """``reconcile(key)``: its answer; a failing reconcile parks the key as unknown."""
        store = self._store
        try:
            answer = yield RECONCILE
        except Exception as exc:
            self.metrics.reconciliations.labels("error").inc()
            if is_outage(exc):
                # The database could not answer: that says nothing about the effect, so
                # the key is not parked. Its record stays pending under its lease (nothing
                # of this transaction commits); the next caller reconciles again.
                raise
            detail = f"reconcile failed: {describe(exc)}"
            yield Sql(store.mark_unknown, store.error_params(e.key, detail))
            yield COMMIT
            self.metrics.unknown.inc()
            raise EffectOutcomeUnknown(e.key, detail) from exc
        applied = answer is not NOT_APPLIED
        self.metrics.reconciliations.labels("applied" if applied else "not_applied").inc()
        tracing.set_current_attributes(
            {tracing.EFFECT_RECONCILED: "applied" if applied else "not_applied"}
        )
        log.info("effect %s reconciled: %s", e.key, "applied" if applied else "not applied")
        return answer

    def _done(self, e: _Effect, value: Any, called: bool) -> Steps:
        stored, invalid = jsonable(e.key, value)
        yield Sql(self._store.finish_done, self._store.outcome_params(e.key, stored, called))
        yield COMMIT
        if invalid is not None:
            raise invalid
        return stored

    def _release(self, e: _Effect) -> Steps:
        yield Sql(self._store.release, self._store.key_params(e.key))
        yield COMMIT

    # -- sync ------------------------------------------------------------------------------
    def run(
        self,
        engine: Engine,
        *,
        key: str | uuid.UUID,
        call: Callable[[str], Any],
        reconcile: Callable[[str], Any] | None = None,
        payload: Any = None,
        window: timedelta | None = None,
        dependency: str = "default",
        classify: Classifier | None = None,
        lease: timedelta | None = None,
    ) -> Any:
        """Call ``call(key)`` at most once for ``key``, or return the stored result.

        ``payload``: the action's arguments (hashed; another payload with the key is an
        :class:`EffectConflict`). ``reconcile(key)`` returns the effect's result if it was
        applied, else :data:`NOT_APPLIED`. The result must be JSON-serializable (it is
        stored as JSONB and replayed as its JSON form: tuples come back as lists).

        Raises :class:`EffectFailed` (permanent, stored), :class:`EffectOutcomeUnknown`,
        :class:`EffectInProgress`, :class:`EffectConflict`, ``CircuitOpen``,
        ``RetryBudgetExhausted`` or the last retryable exception (the claim released).
        """
        effect = self._effect(
            key, payload, dependency, window, lease, classify, reconcile is not None
        )
        with engine.connect() as conn, Feeder(self._steps(effect)) as feed:
            conn.execution_options(isolation_level=_ISOLATION)
            while not isinstance(step := feed.next(), Finished):
                try:
                    if isinstance(step, Sql):
                        with translated_errors():
                            feed.reply = conn.execute(step.statement, step.params)
                    elif isinstance(step, Commit):
                        with translated_errors():
                            conn.commit()
                    elif isinstance(step, Call):
                        feed.reply = call(effect.key)
                    elif isinstance(step, Reconcile):
                        assert reconcile is not None
                        feed.reply = reconcile(effect.key)
                    else:
                        self._sleep(step.seconds)
                except Exception as exc:
                    feed.error = exc
            return step.value

    # -- async -----------------------------------------------------------------------------
    async def run_async(
        self,
        engine: AsyncEngine,
        *,
        key: str | uuid.UUID,
        call: Callable[[str], Awaitable[Any]],
        reconcile: Callable[[str], Awaitable[Any]] | None = None,
        payload: Any = None,
        window: timedelta | None = None,
        dependency: str = "default",
        classify: Classifier | None = None,
        lease: timedelta | None = None,
    ) -> Any:
        """Async :meth:`run`: ``call`` and ``reconcile`` are awaited."""
        sleep = self._async_sleep or asyncio.sleep
        effect = self._effect(
            key, payload, dependency, window, lease, classify, reconcile is not None
        )
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level=_ISOLATION)
            with Feeder(self._steps(effect)) as feed:
                while not isinstance(step := feed.next(), Finished):
                    try:
                        if isinstance(step, Sql):
                            with translated_errors():
                                feed.reply = await conn.execute(step.statement, step.params)
                        elif isinstance(step, Commit):
                            with translated_errors():
                                await conn.commit()
                        elif isinstance(step, Call):
                            feed.reply = await call(effect.key)
                        elif isinstance(step, Reconcile):
                            assert reconcile is not None
                            feed.reply = await reconcile(effect.key)
                        else:
                            await sleep(step.seconds)
                    except Exception as exc:
                        feed.error = exc
                return step.value
